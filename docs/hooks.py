"""MkDocs hooks (placeholder; the docstring check lands here)."""
