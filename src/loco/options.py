"""The building blocks of options, shared by every layer that declares them: the error a bad
option raises and the field helper that gives an option its help text and allowed values.

Torch-free and at the bottom of the package, so that the configuration (above) and the
methods' own option sections (in ``loco.algorithms``) can both use them.
"""

from __future__ import annotations

from dataclasses import field


class ConfigError(ValueError):
    """A bad option: ``option`` is the flag's name, the message says what is allowed.

    The message reads ``--option-name: message``; the command line prints it in one line
    and exits with code 2.

    Args:
        option: the option's name, as a field name (``sync_every``) or a flag without the
            dashes.
        message: what is wrong and what is allowed.
    """

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"--{option.replace('_', '-')}: {message}")


def opt(default, help: str, choices: tuple | None = None, **kw):
    """A dataclass field that is an option: a flag, a YAML key and a line of ``--help``.

    Args:
        default: the option's default.
        help: what it does and what it trades off (``--help`` prints it).
        choices: the allowed values where they are a list; default None (any value of the
            field's type).
        **kw: more metadata for the field.
    """
    return field(default=default, metadata={"help": help, "choices": choices, **kw})


def need(cfg, ok: bool, option: str, message: str) -> None:
    """Raise a ConfigError for ``option`` unless ``ok``; the message ends with the value.

    Args:
        cfg: the configuration holding ``option``.
        ok: whether the value is allowed.
        option: the option's field name.
        message: what is allowed.

    Raises:
        ConfigError: ``ok`` is false: ``--option: message (got value)``.
    """
    if not ok:
        value = cfg.option(option) if hasattr(cfg, "option") else getattr(cfg, option)
        raise ConfigError(option, f"{message} (got {value!r})")
