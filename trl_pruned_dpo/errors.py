"""The one-line errors of the package: each names the problem and the fix, and the CLI prints it as one line.

At the bottom of the package with config.py: anything may raise them, nothing here imports the rest.
"""

# The command line's name, which prefixes every one-line error it prints.
PROG = "trl-pruned-dpo"


class InputError(Exception):
    """Bad user input on the command line: printed as one line (problem and fix), exit code 2."""


class OutputDirError(Exception):
    """The output folder cannot be used: not writable, or another run holds it."""


class ResumeError(ValueError):
    """No checkpoint to resume from, an incomplete one, or a pruning configuration that differs."""


class EmptyTrainingSet(ValueError):
    """Every training row was dropped before training (TRL's truncation filter)."""


class TrainingDiverged(RuntimeError):
    """A non-finite or exploding loss / gradient norm, with the last good checkpoint."""


class DiskFullError(OSError):
    """The disk filled up while a checkpoint or the model was being written, with the last good checkpoint."""


# Bad input (exit 2) and runs that could not go on (exit 1), as the command line reports them.
INPUT_ERRORS = (InputError, ResumeError, OutputDirError, EmptyTrainingSet)
RUN_ERRORS = (*INPUT_ERRORS, TrainingDiverged, DiskFullError)


def exit_code(error: BaseException) -> int:
    return 2 if isinstance(error, INPUT_ERRORS) else 1
