"""The one error type every command turns into a single line for the user."""


class UserError(Exception):
    """Something the user can fix: a bad spec, a missing file, a corrupt input.

    The message is one line naming the file, field or sample and what is wrong; the CLI
    prints it without a traceback and exits non-zero.
    """
