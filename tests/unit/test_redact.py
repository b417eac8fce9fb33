"""Secrets never reach what the tool writes."""

from __future__ import annotations

from pipelines.redact import MASK, redact_mapping, redact_text


def test_secret_looking_keys_are_masked_and_others_kept():
    data = {"launcher.additional_parameters.api_token": "s3cr3t", "x.password": "hunter2",
            "aws_secret_access_key": "AKIA", "train.steps": 8, "model.name": "gpt-tiny", "cache_key": "abc"}
    out = redact_mapping(data)
    assert out["launcher.additional_parameters.api_token"] == MASK and out["x.password"] == MASK
    assert out["aws_secret_access_key"] == MASK and out["cache_key"] == MASK
    assert out["train.steps"] == 8 and out["model.name"] == "gpt-tiny"


def test_credentials_inside_uris_and_assignments():
    assert redact_text("http://alice:pw@mlflow.internal:5000/x") == f"http://{MASK}@mlflow.internal:5000/x"
    assert redact_text("https://TOKEN123@host/path") == f"https://{MASK}@host/path"
    assert redact_text("export HF_TOKEN=abc123 && run") == f"export HF_TOKEN={MASK} && run"
    assert redact_text("sqlite:///outputs/mlflow.db") == "sqlite:///outputs/mlflow.db"
    assert redact_mapping({"launcher.setup": ["module load cuda", "export WANDB_API_KEY=k"]})["launcher.setup"] == [
        "module load cuda", f"export WANDB_API_KEY={MASK}"]
