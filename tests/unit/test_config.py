"""The schema and the cross-field checks: every bad override is one sentence, key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ConfigError
from pipelines.cli import UserError, precheck, split_argv, sweep_points


def test_defaults_compose_to_the_documented_run(compose_cfg):
    cfg = compose_cfg()
    assert (cfg.nodes, cfg.procs_per_node) == (2, 1)
    assert cfg.strategy.name == "ddp" and cfg.launcher.name == "local"
    assert cfg.tracking.uri == "sqlite:///outputs/mlflow.db"
    assert list(cfg.pipeline.stages) == ["env", "bandwidth", "lr_find", "plan", "trials", "train", "report"]


def test_card_form_and_groups(compose_cfg):
    cfg = compose_cfg("strategy=ddp", "nodes=4", "model=mlp", "data=blobs", "tracking=none")
    assert cfg.nodes * cfg.procs_per_node == 4
    assert cfg.model.target == "training.models.mlp.build" and cfg.tracking.name == "none"
    assert cfg.model.kwargs["in_features"] == cfg.data.kwargs["num_features"] == 32


def test_procs_per_node_defaults_to_the_gpus(compose_cfg):
    assert compose_cfg("nodes=1", gpus=4).procs_per_node == 4


BAD = [
    (["plan.calibrate=true", "tracking=none"], "plan.calibrate=True: reads earlier runs from MLflow"),
    (["pipeline=compare"], "study=None: pipeline=compare needs study=<study id or MLflow experiment name>"),
    (["pipeline=compare", "study=s1", "tracking=none"], "tracking='none': pipeline=compare reads MLflow"),
    (["study=two words"], "study='two words': must be 1-200 characters"),
    (["strategy=zero9"], "strategy=zero9: no such option; available: auto, ddp, hybrid, pp, tp, zero1, zero2, zero3"),
    (["strategy=hybrid", "strategy.dp_shard=3"], "= 3, but the world size is 2"),
    (["strategy=hybrid", "strategy.dp_shard=-1", "strategy.tp=-1"], "are all -1"),
    (["strategy=tp", "nodes=3"], "strategy.tp=3: must divide"),
    (["strategy=pp", "nodes=3"], "strategy.pp=3: more pipeline stages than the 2 blocks of model=gpt-tiny"),
    (["strategy=pp", "strategy.microbatches=3"], "strategy.microbatches=3: must divide the micro-batch of 8"),
    (["strategy=tp", "model=mlp", "data=blobs"], "strategy.tp=2: model=mlp has no tensor-parallel plan"),
    (["strategy.precision=fp16"], "strategy.precision='fp16': needs CUDA"),
    (["strategy.ep=2"], "strategy.ep=2: the model declares no experts to split: name its experts modules"),
    (["model=gpt-moe-tiny", "strategy.ep=3", "nodes=3"], "strategy.ep=3: must divide every layer's experts (4)"),
    (["model=gpt-moe-tiny", "strategy=pp", "strategy.ep=2"],
     "strategy.ep=2: must divide the ranks it is carved out of, dp_shard = 1"),
    (["model=gpt-moe-tiny", "strategy=hybrid", "strategy.cp=2", "strategy.tp=2", "strategy.ep=8", "nodes=4"],
     "strategy.ep=8: must divide the ranks it is carved out of, dp_shard x cp x tp = 4"),
    (["plan.precisions=[bf16,fp8]"], "plan.precisions='fp8': is measured on this cluster only by a run in it"),
    (["pipeline=plan", "cluster=a100-80g-ib", "strategy.precision=fp8"],
     "strategy.precision='fp8': cluster=a100-80g-ib has no fp8 tensor cores (cluster.fp8_peak_flops is null)"),
    (["cluster=h100-80g-ndr", "cluster.fp8_peak_flops=0"], "cluster.fp8_peak_flops=0.0: must be > 0"),
    (["strategy.tp=0"], "strategy.tp=0: must be >= 1, -1"),
    (["cluster.device_memory_gib=0"], "cluster.device_memory_gib=0.0: must be > 0 GiB, or null for no budget"),
    (["launcher=slurm", "launcher.setup=['export HF_TOKEN=abc']"],
     "launcher.setup='export HF_TOKEN=***': would write a secret"),
    (["launcher=slurm", "+launcher.additional_parameters.comment=https://u:t0ken@h"],
     "launcher.additional_parameters={'comment': 'https://***@h'}: would write a secret"),
    (["launcher.setup=['export HF_TOKEN=abc']"], "HF_TOKEN=***\": an option of launcher=slurm, not of launcher=local"),
    (["cluster=h100-80g-ndr", "cluster.peak_flops=null"], "cluster.peak_flops=None: cluster=h100-80g-ndr describes"),
    (["cluster.devices_per_node=0"], "cluster.devices_per_node=0"),
    (["plan.overlap=2"], "plan.overlap=2.0: must be in [0, 1]"),
    (["launcher=ray", "launcher.address=nowhere"], "launcher.address='nowhere'"),
    (["launcher=ray", "launcher.max_failures=-1"], "launcher.max_failures=-1"),
    (["train.global_batch=7"], "train.global_batch=7: must be a multiple of data-parallel size 2"),
    (["model=huge"], "model=huge: no such option"),
    (["nodes=abc"], "nodes=abc"),
    (["nodes=0"], "nodes=0: must be an integer >= 1"),
    (["procs_per_node=-1"], "procs_per_node=-1"),
    (["+foo=1"], "foo=1: unknown key"),
    (["foo=1"], "foo"),
    (["train.steps=0"], "train.steps=0: must be an integer >= 1"),
    (["train.lr=-0.1"], "train.lr=-0.1: must be a number > 0"),
    (["train.micro_batch=0"], "train.micro_batch=0"),
    (["train.schedule=linear"], "train.schedule='linear': must be one of cosine, constant"),
    (["model=mlp"], "model.in_features: Interpolation key 'data.num_features' not found"),
    (["model.n_heads=3"], "model='gpt-tiny': training.models.gpt.build raised ValueError: n_heads=3 must divide d_model=64"),
    (["data=text", "model.vocab_size=100"], "data='text': a batch of text does not fit model=gpt-tiny (IndexError"),
    (["bandwidth.max_bytes=4", "bandwidth.min_bytes=8"], "bandwidth.max_bytes=4: must be >= min_bytes=8"),
    (["bandwidth.collectives=[all_reduce,gossip]"], "bandwidth.collectives='gossip'"),
    (["lr_find.max_lr=1e-9"], "lr_find.max_lr=1e-09: must be > min_lr"),
    (["lr_find.suggestion=magic"], "lr_find.suggestion='magic'"),
    (["data.num_samples=4"], "data='markov': holds 4 samples, fewer than one global batch"),
    (["only=[nope]"], "only='nope': is not a stage of pipeline=full"),
    (["force=[train,nope]"], "force='nope'"),
    (["launcher.backend=nccl"], "launcher.backend='nccl': needs a CUDA GPU per rank and this machine shows none"),
    (["launcher.timeout_s=-5"], "launcher.timeout_s=-5.0"),
    (["tracking.experiment="], "tracking.experiment"),
    (["cache_dir=/proc/nope/cache"], "cache_dir='/proc/nope/cache': must be a writable directory"),
    # Each launcher owns its options: another launcher's key is an error naming the one that has it.
    (["launcher=local", "launcher.partition=gpu"], "launcher.partition='gpu': an option of launcher=slurm, not of "
     "launcher=local"),
    (["launcher=slurm", "launcher.address=auto"], "launcher.address='auto': an option of launcher=ray, not of "
     "launcher=slurm"),
    (["+launcher.max_requeues=2"], "launcher.max_requeues=2: an option of launcher=slurm, not of launcher=local"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_override_is_one_clear_line(overrides, expected):
    with pytest.raises(UserError) as info:
        precheck(overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message and "Traceback" not in message


def test_every_sweep_point_is_checked_before_any_runs():
    with pytest.raises(UserError, match="nodes=abc"):
        precheck(["-m", "nodes=1,abc"])
    assert sweep_points(["nodes=1,2", "strategy=ddp"]) == [["nodes=1", "strategy=ddp"], ["nodes=2", "strategy=ddp"]]


def test_hydra_flags_are_not_overrides():
    overrides, multirun, info = split_argv(["-m", "--config-name", "config", "nodes=1,2", "--cfg", "job"])
    assert overrides == ["nodes=1,2"] and multirun and info


def test_config_error_names_the_full_key():
    err = ConfigError("steps", 0, "must be an integer >= 1").prefixed("train")
    assert str(err) == "train.steps=0: must be an integer >= 1"


MODEL_PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("preset", [p for p in MODEL_PRESETS if p != "custom"])
def test_every_model_preset_builds(compose_cfg, preset):
    """Each shipped model file names fields its factory accepts (a library upgrade that renames one,
    as transformers 5 did with rope_theta, fails here rather than in a user's plan)."""
    data = ["data=blobs"] if preset == "mlp" else []  # the MLP's input width is the blobs' feature count
    cfg = compose_cfg(f"model={preset}", *data, "pipeline=plan", "cluster=h100-80g-ndr", "tracking=none")
    assert cfg.model.name == preset


def test_help_is_the_tools_own_and_every_command_it_shows_composes():
    """`python run.py --help` says what the tool does, the common commands and the groups, not Hydra's
    "powered by Hydra" and the whole YAML; each command it shows passes the same check a run does."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(root / "run.py"), "--help"], capture_output=True, text=True,
                            timeout=120, cwd=root)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.startswith("scalestudy: ") and "powered by Hydra" not in text
    assert "strategy: auto, ddp, hybrid, pp, tp, zero1, zero2, zero3" in text
    assert "python run.py --cfg job" in text and "seed:" not in text  # the config is a flag away, not here
    commands = [line.split("python run.py ", 1)[1].split("  ")[0].split() for line in text.splitlines()
                if line.startswith("  python run.py ")]
    assert len(commands) >= 6
    for argv in commands:
        precheck(argv)
