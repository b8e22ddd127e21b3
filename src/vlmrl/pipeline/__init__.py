"""The pipeline as a whole: the Prefect flow's logic over DVC (`orchestration`, with DVC as
the only judge of what is stale), the environment DVC runs in (`dvc_env`), what DVC did read
from its own records (`dvc_records`), and the recipes that write params.yaml (`recipes`). No torch
at import."""
