"""The docs a newcomer reads: every relative link in README.md and docs/ names a file that exists and,
with a `#section`, a heading that exists (GitHub's anchors); the README stays short; docs/defaults.md's
mismatch-correction citations say what each script and library does."""

import dataclasses
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {github_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):  # http(s), mailto: not ours to check offline
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif anchor and path.suffix == ".md" and anchor not in anchors_of(path):
            broken.append(f"{link} (no heading '#{anchor}')")
    return broken


def test_every_relative_link_and_anchor_resolves():
    broken = {page.name: broken_links(page) for page in PAGES}
    assert not {name: links for name, links in broken.items() if links}


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n[ok](#a-heading) [gone](#no-such) [missing](nowhere.md)\n")
    assert broken_links(page) == ["#no-such (no heading '#no-such')", f"nowhere.md (no file {tmp_path / 'nowhere.md'})"]


def test_readme_is_at_most_10_kb():
    assert len((ROOT / "README.md").read_bytes()) <= 10_000  # 10 KB, as the issue counts them


SCRIPTS = ["rloo_kreuse.py", "ppo_oppo.py", "pipeline_rl.py", "online_dpo_async.py"]
# read in TRL 1.16.0's wheel (pyproject's `trl` extra), trl/trainer/grpo_config.py: GRPOTrainer's mismatch correction
TRL_1_16_GRPO_IS = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
                    "vllm_importance_sampling_clip_max": 3.0}


def table_row(page: Path, first_cell: str) -> str:
    return next(line for line in page.read_text().splitlines() if line.startswith(f"| {first_cell} |"))


def args_default(script: str, field: str) -> str | None:
    """A field's default in a script's Args, read from its source (None: the script has no such flag)."""
    match = re.search(rf"^    {field}: [^=\n]+= (.+)$", (ROOT / script).read_text(), re.M)
    return match.group(1) if match else None


def test_the_mismatch_row_says_what_each_script_does():
    """Not one setting shared by all four: each script's part of the row names its own --tis-cap default, or says
    that it has no --tis."""
    row = table_row(ROOT / "docs" / "defaults.md", "training-inference mismatch")
    parts = dict(re.findall(r"`(\w+\.py)`(.*?)(?=`\w+\.py`|\|)", row))
    assert sorted(parts) == sorted(SCRIPTS)
    for script in SCRIPTS:
        cap = args_default(script, "tis_cap")
        expected = "no `--tis`" if cap is None else f"`--tis-cap {cap}`"
        assert expected in parts[script], (script, expected)
    assert args_default("online_dpo_async.py", "tis") is None and args_default("pipeline_rl.py", "tis_cap") == "5.0"


def test_trl_is_cited_for_the_correction_it_makes():
    """TRL 1.16's GRPOTrainer masks whole responses whose ratio exceeds 3 (not per-token truncation): the defaults
    page and rloo_kreuse.py's --tis-level help say so (checked against TRL itself where the `trl` extra is in)."""
    if importlib.util.find_spec("trl"):
        from trl import GRPOConfig

        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        assert {name: defaults[name] for name in TRL_1_16_GRPO_IS} == TRL_1_16_GRPO_IS
    defaults_md = ROOT / "docs" / "defaults.md"
    rloo_source = (ROOT / "rloo_kreuse.py").read_text()
    tis_level_help = re.search(r'\n    tis_level: .*?\n    """(.*?)"""', rloo_source, re.S).group(1)
    for where, text in [("mismatch row", table_row(defaults_md, "training-inference mismatch")),
                        ("--tis-level row", table_row(defaults_md, "`--tis-level`")),
                        ("--tis-level help", " ".join(tis_level_help.split()))]:
        assert '"sequence_mask"' in text and "TRL 1.16" in text, where
        assert "TRL's and verl's default" not in text and "token truncation" not in text, where
