"""A hub id is checked before anything loads it: transformers and datasets retry an unreachable
hub for about half a minute and then print a page of tracebacks, and a mistyped id fails only
after that. One request with a short timeout tells a typo, an unreachable hub and an offline
machine apart, each in one line that says what to do. An id found in the local Hugging Face
cache needs no hub. No torch at import."""

from __future__ import annotations

from vlmrl.errors import ParamsError

TIMEOUT_S = 10.0
OFFLINE_HINT = ("download it where the hub is reachable (`hf download {id}{kind}`) and set "
                "HF_HUB_OFFLINE=1, or name a local folder")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or its older spellings), as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def check_hub_model(repo_id: str, key: str = "model.name") -> None:
    """Passes where the model is in the local cache or on the hub; else one ParamsError line."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return
    except HFValidationError as error:
        raise ParamsError(f"params.yaml {key}: {repo_id!r} is neither a hub id nor a local "
                          f"folder ({error})") from None
    check_on_hub(repo_id, key, "model")


def check_hub_dataset(repo_id: str, key: str = "data.source") -> None:
    """Passes where the dataset is on the hub, or the hub is off (datasets then reads its own
    cache, and names what is missing); else one ParamsError line."""
    if not hub_offline():
        check_on_hub(repo_id, key, "dataset")


def check_on_hub(repo_id: str, key: str, kind: str) -> None:
    """One request for the repo's info; a typo, a private repo, an unreachable or switched-off
    hub each become a ParamsError naming `key`."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    hint = OFFLINE_HINT.format(id=repo_id, kind=" --repo-type dataset" if kind == "dataset" else "")
    if hub_offline():
        raise ParamsError(f"params.yaml {key}: {kind} {repo_id!r} is not in the local Hugging "
                          f"Face cache and the hub is off (HF_HUB_OFFLINE): {hint}")
    try:
        HfApi().repo_info(repo_id, repo_type=kind, timeout=TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; the download says what access it needs
    except RepositoryNotFoundError:
        raise ParamsError(f"params.yaml {key}: no {kind} {repo_id!r} on the Hugging Face hub "
                          "(a typo? a private one needs `hf auth login`)") from None
    except HFValidationError as error:
        raise ParamsError(f"params.yaml {key}: {repo_id!r} is neither a hub id nor a local "
                          f"folder ({error})") from None
    except OfflineModeIsEnabled:
        raise ParamsError(f"params.yaml {key}: the hub is off (HF_HUB_OFFLINE): {hint}") from None
    except (OSError, httpx.TransportError) as error:  # no network, DNS, a timeout
        raise ParamsError(f"params.yaml {key}: the Hugging Face hub cannot be reached "
                          f"({error}) to get {kind} {repo_id!r}: {hint}") from None
