"""The measured tables of docs/benchmarks.md and README.md are written by the benchmark scripts
from their stored results (benchmarks/doc_tables.py), every results file kept is read by a table,
each render mode stops with one line naming the file and the field a results file lacks, and
every relative link of the docs leads to a file and a heading that exist."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import ROOT, benchmark_fixture, run

RESULTS = ROOT / "benchmarks" / "results"
LINKED_DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md",
                      ROOT / "tests/gpu/README.md"])


doc_tables = benchmark_fixture("doc_tables")


def test_every_table_is_as_its_script_writes_it(doc_tables, tmp_path: Path) -> None:
    """A figure typed into a copy is rewritten from the results file, and the rewritten copies
    equal the committed docs: no table was typed by hand or left behind its results file."""
    copies = {key: tmp_path / Path(path).name for key, path in doc_tables.DOCS.items()}
    for key, path in doc_tables.DOCS.items():
        shutil.copyfile(ROOT / path, copies[key])
    doc = copies["{doc}"]
    assert "| 25.22 |" in doc.read_text()  # the Unsloth reference on the 2B shape, speed table
    doc.write_text(doc.read_text().replace("| 25.22 |", "| 99.99 |"))
    doc_tables.rewrite(copies)
    for key, path in doc_tables.DOCS.items():
        assert copies[key].read_text() == (ROOT / path).read_text(), (
            f"{path} differs from what its scripts write: python benchmarks/doc_tables.py")


def test_every_results_file_is_read_by_a_table(doc_tables) -> None:
    """benchmarks/results/ holds the files behind today's tables, no more: a superseded run
    lives in git history."""
    assert doc_tables.unread_results() == []


def without(path: Path, tmp_path: Path, *keys: str) -> Path:
    """A copy of a results file with `keys` (a path into the JSON, the last one removed)."""
    data = json.loads(path.read_text())
    node = data
    for key in keys[:-1]:
        node = node[key] if not isinstance(node, list) else node[int(key)]
    del node[keys[-1]]
    copy = tmp_path / path.name
    copy.write_text(json.dumps(data))
    return copy


def fails_naming(argv: list[str], *names: str) -> None:
    result = run([sys.executable, *argv], ROOT, check=False)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert all(name in last for name in names), result.stderr[-2000:]


def marked_doc(tmp_path: Path, *pairs: tuple[str, str], name: str = "doc.md") -> Path:
    doc = tmp_path / name
    doc.write_text("intro\n" + "".join(f"{begin}\n{end}\n" for begin, end in pairs) + "tail\n")
    return doc


def test_learning_summary_puts_seeds_down_and_runs_across(tmp_path: Path) -> None:
    doc = marked_doc(tmp_path, ("<!-- benchmarks/learning.py:begin:summary -->",
                                "<!-- benchmarks/learning.py:end:summary -->"))
    cpu, gpu = RESULTS / "learning.json", RESULTS / "learning_gpu_unsloth.json"
    run([sys.executable, "benchmarks/learning.py", "--summary", str(cpu), str(gpu), "--doc",
         str(doc)], ROOT)
    lines = doc.read_text().splitlines()
    assert "| seed | CPU, the defaults | H100 80GB HBM3, `model.backend=unsloth` |" in lines
    assert "| 0 | +24.0 / +0.458 | +28.1 / +0.333 |" in lines
    assert "| 9 | +33.3 / +0.385 | not run |" in lines
    assert any(line.startswith("| claim | **holds** (standard error 3.8 points)") for line in lines)
    broken = without(gpu, tmp_path, "runs", "1", "mean_reward")
    fails_naming(["benchmarks/learning.py", "--summary", str(cpu), str(broken), "--doc", str(doc)],
                 str(broken), "'mean_reward'")


@pytest.mark.parametrize(("script", "flag", "missing"), [("learning", "--from-json", "summary"),
                                                     ("pipeline", "--render", "cached_flow")])
def test_rendering_from_results_names_a_missing_field(tmp_path: Path, script: str, flag: str,
                                                       missing: str) -> None:
    """`benchmarks/<script>.py` rendering its results file without `missing` names the file and
    the field."""
    doc = marked_doc(tmp_path, (f"<!-- benchmarks/{script}.py:begin -->",
                                f"<!-- benchmarks/{script}.py:end -->"))
    broken = without(RESULTS / f"{script}.json", tmp_path, missing)
    fails_naming([f"benchmarks/{script}.py", flag, str(broken), "--doc", str(doc)],
                 str(broken), f"'{missing}'")


def test_gspo_step_speed_summary_compares_within_a_file_and_marks_other_machines(
        tmp_path: Path) -> None:
    doc = marked_doc(tmp_path, ("<!-- gspo_step speed: start -->", "<!-- gspo_step speed: end -->"))
    readme = marked_doc(tmp_path, ("<!-- gspo_step speed-readme: start -->",
                                   "<!-- gspo_step speed-readme: end -->"), name="README.md")
    files = [str(RESULTS / name) for name in ("gspo_step.json", "gspo_step_h200x2_8b_four.json")]
    run([sys.executable, "benchmarks/gspo_step.py", "--from-json", *files, "--doc-block", "speed",
         "--doc", str(doc), "--readme", str(readme)], ROOT)
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| qwen3")]
    # the first file's 2B rows against its own Unsloth and TRL's generate at the same length
    assert ("| qwen3-vl-2b-shape | 1024 | `transformers_4bit` | 73.37 | 222 | 4.41 (7.80) | "
            "1.63x | 0.29x | `gspo_step.json` |") in rows
    # 8B: TRL's generate from the first file that has it; the second file's recipe against it
    # (another machine: †) and against its own Unsloth at 256 tokens (another length: ‡)
    assert any(row.startswith("| qwen3-vl-8b-shape | 1024 | `gpu_profile_mb8_spg4_rows16` | "
                              "43.01 |") and row.endswith("`gspo_step.json` |") for row in rows)
    assert ("| qwen3-vl-8b-shape | 1024 | `gpu_profile_graph_fp8_mb4_rolled_compiled_images` | "
            "7.56 | 2168 | 10.03 (11.48) | 26.54x ‡ | 5.69x † | "
            "`gspo_step_h200x2_8b_four.json` |") in rows
    assert ("qwen3-vl-8b-shape: `unsloth_4bit` at 256 tokens 50.14 s per step (82 tokens/s), "
            "peak 9.51 GiB;") in readme.read_text()
    broken = without(RESULTS / "gspo_step_h200x2_8b_four.json", tmp_path, "runs",
                     "unsloth_4bit@256@qwen3-vl-8b-shape", "peak_reserved_gib")
    fails_naming(["benchmarks/gspo_step.py", "--from-json", files[0], str(broken), "--doc-block",
                  "speed", "--doc", str(doc)], str(broken), "'peak_reserved_gib'")


def test_gspo_step_speed_summary_takes_only_the_named_configurations_of_a_file(
        tmp_path: Path) -> None:
    """`FILE::CONFIG,...`: a file contributes only those configurations' runs."""
    doc = marked_doc(tmp_path, ("<!-- gspo_step speed: start -->", "<!-- gspo_step speed: end -->"))
    source = f"{RESULTS / 'gspo_step.json'}::unsloth_4bit"
    run([sys.executable, "benchmarks/gspo_step.py", "--from-json", source, "--doc-block", "speed",
         "--doc", str(doc)], ROOT)
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| qwen3")]
    assert [row.split(" | ")[1:3] for row in rows] == [["256", "`unsloth_4bit`"],
                                                         ["1024", "`unsloth_4bit`"]]


def test_gspo_step_from_json_writes_one_files_block(tmp_path: Path) -> None:
    doc = marked_doc(tmp_path, ("<!-- gspo_step pool-2b: start -->",
                                "<!-- gspo_step pool-2b: end -->"))
    source = RESULTS / "gspo_step_h200x2_pool_2b.json"
    run([sys.executable, "benchmarks/gspo_step.py", "--from-json", str(source), "--doc-block",
         "pool-2b", "--doc", str(doc)], ROOT)
    assert "| qwen3-vl-2b-shape | `unsloth_4bit` | 256 | 25.22 |" in doc.read_text()
    fails_naming(["benchmarks/gspo_step.py", "--from-json", str(source), str(source),
                  "--doc-block", "pool-2b", "--doc", str(doc)], "one results file")
    broken = without(source, tmp_path, "runs")
    fails_naming(["benchmarks/gspo_step.py", "--from-json", str(broken), "--doc-block", "pool-2b",
                  "--doc", str(doc)], str(broken), "'runs'")


def test_scaling_render_names_a_missing_field(tmp_path: Path) -> None:
    doc = marked_doc(tmp_path, ("<!-- benchmarks/scaling.py:begin:summary -->",
                                "<!-- benchmarks/scaling.py:end:summary -->"),
                     ("<!-- benchmarks/scaling.py:begin -->", "<!-- benchmarks/scaling.py:end -->"))
    broken = without(RESULTS / "scaling.json", tmp_path, "runs", "strong",
                     "generated_tokens_per_second")
    fails_naming(["benchmarks/scaling.py", "--render", str(broken), "--out", str(broken),
                  "--doc", str(doc)], str(broken), "'generated_tokens_per_second'")
    assert "strong" not in doc.read_text()  # nothing written


def test_cpu_kernels_from_json_writes_its_table_and_names_a_missing_field(tmp_path: Path) -> None:
    doc = marked_doc(tmp_path, ("<!-- benchmarks/cpu_kernels.py:begin -->",
                                "<!-- benchmarks/cpu_kernels.py:end -->"))
    run([sys.executable, "benchmarks/cpu_kernels.py", "--from-json",
         str(RESULTS / "cpu_kernels.json"), "--doc", str(doc)], ROOT)
    assert "| `TopKSampler`, the same distribution | 26.0 |" in doc.read_text()
    broken = without(RESULTS / "cpu_kernels.json", tmp_path, "log_probs", "fused_forward_ms")
    fails_naming(["benchmarks/cpu_kernels.py", "--from-json", str(broken), "--doc", str(doc)],
                 str(broken), "'fused_forward_ms'")


def test_a_missing_results_file_is_named(tmp_path: Path) -> None:
    doc = marked_doc(tmp_path, ("<!-- benchmarks/pipeline.py:begin -->",
                                "<!-- benchmarks/pipeline.py:end -->"))
    missing = tmp_path / "nowhere.json"
    fails_naming(["benchmarks/pipeline.py", "--render", str(missing), "--doc", str(doc)],
                 f"{missing}: no such results file")


# ------------------------------------------------------------------ links

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores
    dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    return broken


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_a_link_to_a_missing_heading_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Does it learn? (`x.py`)\n\n## Details\n\n## Details\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#does-it-learn-xpy), [ok](a.md#details-1), [no](a.md#results),\n"
                   "[no](c.md), [ok](https://example.org/x)\n```\n[skipped](d.md)\n```\n")
    assert broken_links(doc) == ["a.md#results: no heading with anchor #results in a.md",
                                 f"c.md: no file {tmp_path / 'c.md'}"]
