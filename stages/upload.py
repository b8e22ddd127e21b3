"""DVC stage `upload`: render the model cards and publish this run's adapter, merged model and
GGUF files (each with its card as README.md) and metrics to S3.

Thin on purpose: it parses params, calls vlmrl.publish and writes the three outputs, which appear
(atomically) only once the upload has fully succeeded. With no upload.bucket it writes the manifest
locally, uploads nothing and succeeds, so the pipeline runs end to end without cloud credentials.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmrl.errors import run_stage
from vlmrl.outputs import stage_outputs, stage_parser, write_json_atomic, write_text_atomic
from vlmrl.params import load_params
from vlmrl.publish import S3Location, UploadResult, params_hash, publish
from vlmrl.publish.model_card import CardInputs, build_release_cards
from vlmrl.publish.upload import check_upload_params
from vlmrl.reporting.metrics import write_stage_metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The stage's paths (from `sys.argv` where `argv` is None): the artifact folders and metrics
    it publishes, the metrics the cards report, the manifest and cards it writes; `--promote`."""
    parser = stage_parser(__doc__.splitlines()[0])
    option = parser.add_argument
    option("--adapter", type=Path, required=True)
    option("--merged", type=Path, required=True)
    option("--gguf", type=Path, required=True)
    option("--metrics-dir", type=Path, required=True, help="published whole, as the metrics group")
    for name in ("baseline", "post", "export"):
        option(f"--{name}-metrics", type=Path, required=True,
               help=f"the {name} stage's metrics, which the model cards report")
    option("--manifest", type=Path, required=True)
    option("--model-card", type=Path, required=True,
           help="rendered here and published as the merged model's README.md")
    option("--adapter-card", type=Path, required=True,
           help="rendered here and published as the adapter's README.md")
    option("--gguf-card", type=Path, required=True,
           help="rendered here and published as the GGUF folder's README.md")
    option("--promote", action="store_true",
           help="point latest at this version even if it names a version created later")
    return parser.parse_args(argv)


def report_upload(result: UploadResult, location: S3Location, manifest_out: Path) -> None:
    """Prints what the upload did at `location`: a bucket created, a release already published
    from the same inputs, or how many files went up and how many were already there.

    Args:
        result: what `publish` returned.
        location: the bucket and prefix it published to.
        manifest_out: where the stage wrote the release's manifest, named in the line.
    """
    if result.bucket_created:
        print(f"created bucket '{location.bucket}' at {location.endpoint_description()}")
    if result.already_published:
        print(f"version {result.version} already published from the same inputs at "
              f"{location.url(result.version)}/: nothing uploaded; its manifest written to "
              f"{manifest_out}")
        return
    manifest_state = "uploaded" if result.manifest_uploaded else "already there"
    print(
        f"published {location.url(result.version)}/: of {len(result.manifest['files'])} files, "
        f"{result.uploaded_files} uploaded and {result.skipped_files} already there; "
        f"manifest.json {manifest_state}; manifest written to {manifest_out}"
    )


def main(argv: list[str] | None = None) -> int:
    """The stage: check the upload params, render the three model cards and publish the release
    (without `upload.bucket`, only the manifest, locally); the outputs appear once all of it
    succeeded. Returns the exit status."""
    args = parse_args(argv)
    outputs = (args.manifest, args.metrics, args.details, args.model_card,
               args.adapter_card, args.gguf_card)
    card_paths = {"merged": args.model_card, "adapter": args.adapter_card, "gguf": args.gguf_card}
    inputs = {"adapter": args.adapter, "merged": args.merged, "gguf": args.gguf,
              "metrics": args.metrics_dir}
    card_inputs = CardInputs(baseline_metrics=args.baseline_metrics,
                             post_metrics=args.post_metrics,
                             export_metrics=args.export_metrics, gguf=args.gguf)
    all_params = load_params(args.params)  # a bad param fails here, before any file moves
    upload_params = all_params.upload
    if args.promote:
        upload_params = upload_params.model_copy(update={"promote": True})
    check_upload_params(upload_params)
    with stage_outputs(*outputs):
        for group, card in build_release_cards(all_params.raw, card_inputs).items():
            write_text_atomic(card_paths[group], card)
        result = publish(inputs, upload_params, params_digest=params_hash(all_params.raw),
                         cards=card_paths)
        write_json_atomic(args.manifest, result.manifest)
        write_stage_metrics("upload", result.summary(), metrics=args.metrics,
                            details=args.details)
    if result.location is None:
        print(
            "no upload.bucket configured: nothing was uploaded; "
            f"manifest written to {args.manifest} (version {result.version})"
        )
    else:
        report_upload(result, result.location, args.manifest)
        if result.latest != result.version:
            print(
                f"latest still names {result.latest}, created after {result.version}; "
                "pass --promote or set upload.promote: true to point it here"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_stage("upload", main))
