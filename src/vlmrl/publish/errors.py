"""Errors of publishing and pulling; each message is meant for the person at the CLI."""

from __future__ import annotations

from vlmrl.errors import UserError


class PublishError(UserError, RuntimeError):
    """Anything that stops an upload or a pull; the message is meant for the person at the CLI."""


class MissingInputError(PublishError):
    """An input the release is built from (an artifact folder, the GGUF folder's README) is not
    there; the message names it and the stage that makes it."""


class CredentialsError(PublishError):
    """The store refused or never got usable credentials (none in the AWS chain, an unknown key,
    a bad secret, no permission); the message names the bucket and endpoint, never a secret."""


class VersionConflictError(PublishError):
    """The version is already published with other files, or with a manifest that is not valid,
    and `upload.overwrite` is off."""


class IntegrityError(PublishError):
    """What the store holds does not match what it should: an object of another size or SHA256
    than its manifest says, a path that leaves the destination, a read past its limit."""

