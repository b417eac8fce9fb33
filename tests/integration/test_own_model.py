"""A user's own model and data, in a directory outside this repository, through every stage.

The worked example of docs/your-model.md is extracted from that page itself, written into a
temporary directory and run with exactly its commands: if the page drifts from what works, this
fails. Then the same model at world 2 against one process, step for step, and
each bad declaration as the one-line error a user gets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import asked_statuses

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FILE = re.compile(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", re.S)
COMMANDS = re.compile(r"<!-- commands: (\S+) -->\n```bash\n(.*?)```", re.S)
STAGES = ["env", "bandwidth", "lr_find", "plan", "train", "report"]


def readme_example() -> tuple[dict[str, str], str, list[str]]:
    text = (ROOT / "docs" / "your-model.md").read_text()
    files = dict(FILE.findall(text))
    (workdir, script), = COMMANDS.findall(text)
    return files, workdir, [line for line in script.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The example's files, written outside the repository."""
    root = tmp_path_factory.mktemp("outside")
    assert ROOT not in root.parents
    files, workdir, _ = readme_example()
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body)
    return root / workdir


def shell(project: Path, line: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "SS": str(ROOT), "PYTHONPATH": str(project)}
    return subprocess.run(["bash", "-c", line], cwd=project, env=env, capture_output=True, text=True, timeout=timeout)


def summary_of(result: subprocess.CompletedProcess) -> dict:
    path = re.search(r"^summary: (.+)$", result.stdout, re.M).group(1)
    return json.loads(Path(path).read_text())


def run_py(project: Path, *args: str) -> subprocess.CompletedProcess:
    return shell(project, " ".join([sys.executable, str(ROOT / "run.py"), *args]))


@pytest.fixture(scope="module")
def readme_runs(project) -> list[dict]:
    """Every command of the example, exactly as written, in order."""
    _, _, lines = readme_example()
    assert lines[0] == "export PYTHONPATH=$PWD"
    summaries = []
    for line in lines[1:]:
        result = shell(project, f"{lines[0]}; {line}")
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        summaries.append(summary_of(result))
    return summaries


def test_the_readme_example_runs_every_stage_on_the_users_model(readme_runs):
    first, split, inline = readme_runs
    assert asked_statuses(first) == dict.fromkeys(STAGES, "ran")
    train = first["stages"]["train"]["result"]
    assert train["strategy"] == "zero3" and train["world_size"] == 2
    assert train["final_loss"] < 0.5 * train["losses"][0], "the ViT learns the prototypes"
    plan = first["stages"]["plan"]["result"]
    # Measured from the module: 2 blocks (the only ModuleList), its TP plan from the YAML, images
    # count as one "token" each, and the FLOPs of a forward and backward counted on the meta device
    # (its attention is not causal: counted in full).
    assert plan["anatomy"]["shape"]["layers"] == 2 and plan["anatomy"]["tokens_per_sample"] == 1
    assert plan["anatomy"]["shape"]["block_linear_params"] > 0 and plan["anatomy"]["flops_per_sample"] > 0
    assert plan["flops_convention"] == "full"
    assert split["stages"]["train"]["result"]["strategy"] == "tp" and split["ok"]
    assert split["stages"]["train"]["result"]["ranks_in_sync"]
    assert inline["run"]["model"] == "custom" and inline["stages"]["train"]["status"] == "ran"
    assert inline["stages"]["plan"]["result"]["anatomy"]["shape"]["layers"] == 3, "+model.depth=3 reached the factory"


def test_the_users_model_at_world_2_matches_one_process_step_for_step(project, tmp_path):
    """ddp and zero3 at world 2 through the whole DAG (a fresh cache each: every stage runs), with
    the global batch fixed, against one process: the same losses, step for step."""
    common = ["model=custom", "model._target_=my_models.vit.build", "data=custom", "data._target_=my_models.images.build",
              "train.global_batch=8", "lr_find.batch=4", "train.steps=12", "bandwidth.max_bytes=1048576"]
    losses = {}
    for strategy, nodes in (("ddp", 2), ("zero3", 2), ("ddp", 1)):
        result = run_py(project, *common, f"strategy={strategy}", f"nodes={nodes}", f"cache_dir={tmp_path / strategy}{nodes}",
                        "tracking=none")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summary = summary_of(result)
        assert asked_statuses(summary) == dict.fromkeys(STAGES, "ran")
        losses[strategy, nodes] = summary["stages"]["train"]["result"]["losses"]
    one = losses["ddp", 1]
    assert one[-1] < one[0]
    for key in (("ddp", 2), ("zero3", 2)):
        assert losses[key] == pytest.approx(one, rel=1e-4, abs=1e-5), key


BAD = [
    (["model=custom", "model._target_=my_models.nope.build"],
     "model._target_='my_models.nope.build': cannot be imported (ModuleNotFoundError: No module named 'my_models.nope')"),
    (["model=custom", "model._target_=my_models.images.build"],
     "model._target_='my_models.images.build': returned a Prototypes, not a torch.nn.Module"),
    (["--config-dir", "conf", "model=my_vit", "data=my_images", "+model.width=3"],
     "model.width=3: my_models.vit.build takes no argument 'width'; it takes image_size, patch, dim, depth, heads, classes"),
    (["--config-dir", "conf", "model=my_vit", "data=custom", "data._target_=my_models.bad.triples", "+data.image_size=16",
      "+data.classes=10"],
     "data='custom': item 0 of my_models.bad.triples is a 3-tuple; a dataset item must be an (input, target) pair"),
    (["model=custom", "model._target_=my_models.vit.build", "data=markov"],
     "data='markov': a batch of markov does not fit model=custom (RuntimeError"),
    (["model=custom", "model._target_=my_models.vit.build", "data=custom", "data._target_=my_models.images.build",
      "strategy=tp"], "strategy.tp=2: model=custom has no tensor-parallel plan: give model.tp_plan"),
    (["--config-dir", "conf", "model=my_vit", "data=my_images", "strategy=pp"],
     "strategy.pp=2: TinyViT declares no pipeline layout: keep its blocks in an nn.ModuleDict, set pp_first and pp_last"),
    (["--config-dir", "conf", "model=my_vit", "data=my_images", "strategy=tp", "nodes=3"],
     "strategy.tp=3: must divide"),
    (["--config-dir", "conf", "model=my_vit", "data=my_images", "model.tp_plan={blocks.*.q: diagonal}"],
     "model.tp_plan.blocks.*.q='diagonal': must be one of colwise, rowwise, colwise_rep, rowwise_rep"),
    (["model=custom", "data=custom", "data._target_=my_models.images.build"], "model._target_"),
]


@pytest.mark.parametrize(("args", "expected"), BAD, ids=[" ".join(a[-2:]) for a, _ in BAD])
def test_a_bad_declaration_is_one_line_before_any_rank_starts(project, tmp_path, args, expected):
    (project / "my_models" / "bad.py").write_text(
        "import torch\n\n\ndef triples(**kwargs):\n    return [(torch.zeros(3), torch.zeros(1), 0)] * 8\n")
    run_dir = tmp_path / "run"
    result = run_py(project, *[f"'{a}'" for a in args], f"hydra.run.dir={run_dir}", f"cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "cache").exists() and not run_dir.exists(), "nothing written"


CLUSTER_RUN = ["--config-dir", "conf", "model=my_vit", "data=my_images", "strategy=zero3", "nodes=2", "tracking=none",
               "train.global_batch=8", "lr_find.batch=4", "train.steps=10", "bandwidth.max_bytes=65536"]
"""zero3 at world 2 on the user's model, as the cluster launchers run it."""


@pytest.fixture(scope="module")
def local_losses(project, tmp_path_factory) -> list[float]:
    """The losses `launcher=local` trains with CLUSTER_RUN: what Ray and Slurm must reproduce."""
    result = run_py(project, *CLUSTER_RUN, f"cache_dir={tmp_path_factory.mktemp('local') / 'cache'}", "launcher=local")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return summary_of(result)["stages"]["train"]["result"]["losses"]


@pytest.mark.parametrize("launcher", ["ray", "slurm"])
def test_the_users_model_through_ray_and_slurm(project, tmp_path, launcher, local_losses):
    """zero3 at world 2 on the cluster launchers: every stage runs on the user's model there, with
    the same losses as launcher=local."""
    from tests.helpers import need_slurm

    if launcher == "slurm":
        need_slurm()
    ray_env = f"HOME={tmp_path / 'home'} RAY_TMPDIR=$(mktemp -d /tmp/ss-om-XXXX)"
    there = shell(project, " ".join([ray_env, sys.executable, str(ROOT / "run.py"), *CLUSTER_RUN,
                                     f"cache_dir={tmp_path / 'cache'}", f"launcher={launcher}"]))
    assert there.returncode == 0, there.stdout[-3000:] + there.stderr[-3000:]
    summary = summary_of(there)
    assert asked_statuses(summary) == dict.fromkeys(STAGES, "ran")
    assert summary["placement"]["launcher"] == launcher
    assert summary["stages"]["train"]["result"]["losses"] == pytest.approx(
        local_losses, rel=1e-4, abs=1e-5)


LLAMA3_8B_PARAMS = 8_030_261_248
"""Meta's Llama 3 8B: 32 layers, width 4096, FFN 14336, 8 KV heads of 128, 128256 tokens, untied head."""


def test_the_full_size_hugging_face_model_gets_a_what_if_plan(tmp_path):
    """The preset at its real shape, built on the meta device (nothing allocated): the plan counts
    its parameters from the module, measures its FLOPs, and recommends a layout that fits."""
    seq = 4096
    result = subprocess.run([sys.executable, str(ROOT / "run.py"), "pipeline=plan", "model=hf-llama3-8b",
                             "cluster=h100-80g-ndr", "nodes=4", f"data.seq_len={seq}", "tracking=none",
                             "hydra.run.dir=whatif"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    plan = json.loads((tmp_path / "whatif/summary.json").read_text())["stages"]["plan"]["result"]
    shape = plan["anatomy"]["shape"]
    assert shape["params"] == LLAMA3_8B_PARAMS and shape["layers"] == 32 and shape["seq_len"] == seq
    # 6 FLOPs per non-embedding parameter per token, plus causal attention's score and value
    # products: half of the full matrix's 12 x layers x width x tokens^2.
    dense = 6 * (LLAMA3_8B_PARAMS - 128256 * 4096) * seq + 6 * 32 * 4096 * seq**2
    assert plan["anatomy"]["flops_per_sample"] == pytest.approx(dense, rel=0.05)
    assert plan["flops_convention"] == "causal_half"
    best = plan["recommended"]
    assert best is not None and best["fits"] and plan["world_size"] == 32
    assert best["memory_per_device_bytes"] <= 0.7 * 80 * 2**30  # 80 GiB at plan.memory_fraction
    assert all(c["fits"] and c["tokens_per_s"] <= best["tokens_per_s"] for c in plan["candidates"])
    assert best["command"].startswith("python run.py") and "model=hf-llama3-8b" in best["command"]
