"""Errors of publishing and pulling; each message is meant for the person at the CLI."""

from __future__ import annotations

from vlmrl.errors import UserError


class PublishError(UserError, RuntimeError):
    """Anything that stops an upload or a pull; the message is meant for the person at the CLI."""


class MissingInputError(PublishError):
    pass


class CredentialsError(PublishError):
    pass


class VersionConflictError(PublishError):
    pass


class IntegrityError(PublishError):
    pass

