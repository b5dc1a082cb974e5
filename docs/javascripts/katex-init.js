// Render the maths that pymdownx.arithmatex (generic mode) wraps in .arithmatex elements,
// as \( ... \) inline and \[ ... \] display, with the vendored KaTeX (0.19.1, MIT, see
// katex/LICENSE). document$ is Material's page observable: it fires on every page load,
// instant navigation included.
document$.subscribe(({ body }) => {
  for (const element of body.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
});
