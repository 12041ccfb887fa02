"""The one error hierarchy of verbatim.

Every error that verbatim raises on purpose derives from :class:`VerbatimError`.
The CLI prints such an error as a single line (``error: <message>``), with the
exit code the class declares: 2 for bad input the user can fix, 1 for failures.
"""

from __future__ import annotations


class VerbatimError(Exception):
    """Base class: a known failure with a message that says what to fix."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message if not self.hint else f"{self.message} ({self.hint})"
        return " ".join(text.split())


LONGEST_WORD = 160
"""Characters of one word (a path, a URL, a value) an error line repeats; longer ones are cut."""


def shorten(line: str, longest: int = LONGEST_WORD) -> str:
    """``line`` with every word longer than ``longest`` cut to its start and end and its length."""
    def cut(word: str) -> str:
        if len(word) <= longest:
            return word
        keep = longest // 2
        return f"{word[:keep]}…{word[-20:]} ({len(word):,} characters)"
    return " ".join(cut(w) for w in line.split(" "))


class InputError(VerbatimError):
    """Bad input: a wrong argument, file, name or value. Exit code 2."""

    exit_code = 2


class LedgerError(VerbatimError):
    """An operation that would break the append-only token ledger."""


class TraceError(VerbatimError):
    """A trace directory or file that cannot be written or read."""


class TraceFormatError(TraceError, InputError):
    """A path that is not a verbatim trace, or one from a newer schema."""

    exit_code = 2


class ModelError(VerbatimError):
    """A model that cannot be resolved, prepared or loaded."""


class UnknownModelError(ModelError, InputError):
    exit_code = 2


class DependencyError(VerbatimError):
    """An optional dependency is missing; the message names the install command (:func:`install_hint`)."""


DISTRIBUTION = "verbatim-rl"
"""This project's name on PyPI. ``verbatim`` there is an unrelated package (a speech-to-text tool with its own
``verbatim`` module and command): an install hint never names it."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` of this project (``pip install 'verbatim-rl[wandb]'``), and the plain
    packages it brings, as the installed project's metadata lists them (``, or pip install 'wandb>=0.19'``)."""
    hint = f"pip install '{DISTRIBUTION}[{extra}]'"
    packages = extra_requirements(extra)
    return hint if not packages else f"{hint}, or pip install {' '.join(repr(p) for p in packages)}"


def extra_requirements(extra: str) -> list[str]:
    """The requirements ``extra`` adds (``['wandb>=0.19']``), read from this project's installed metadata;
    empty where it is not installed as a distribution."""
    from importlib import metadata

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    marker = f'extra == "{extra}"'
    return [r.split(";")[0].strip().replace(" ", "") for r in requires if marker in r]


class EngineError(VerbatimError):
    """The inference engine failed or refused a request."""


class NoLoraError(InputError):
    """An engine that serves no LoRA adapter was given one (a LoRA run then pushes merged weights instead)."""


class BenchmarkError(VerbatimError):
    """A benchmark's work failed (an errored rollout, a failed request): no table is printed or written."""


class RenderError(VerbatimError):
    """A renderer cannot produce or continue a token sequence."""


class TrainerError(VerbatimError):
    """Trainer-side input that cannot be corrected or trained on (missing logprobs, mismatched shapes)."""

    exit_code = 2


class TeamError(VerbatimError):
    """A trainer rank died or stopped answering: the run stops (exit code 1) and ``--resume`` goes on."""


class CheckpointError(TrainerError):
    """A trainer checkpoint that cannot be written, or read into this model and optimizer. Exit code 2."""

    exit_code = 2


class EnvError(VerbatimError):
    """An environment that cannot be built or cannot play its task (not bad model output: that is an observation)."""


class RunInterrupted(VerbatimError):
    """A run stopped by a signal: the exit code is 128 + the signal's number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, message: str, *, exit_code: int = 130, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.exit_code = exit_code


def stacks_on_request() -> None:
    """``kill -USR1 PID`` makes this process write every thread's stack to its stderr and go on: where a run
    that seems stuck is waiting. POSIX only; a process without a real stderr (embedded, captured) skips it."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, RuntimeError, ValueError):  # no stderr file to write to
            pass
