"""The shipped Serve config builds the application (``serve run`` / ``serve deploy`` take it as is)."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from app.config import Settings

CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"


def test_serve_config_args_are_valid_settings_and_build_the_app(model_dir):
    from ray.serve import Application

    cfg = yaml.safe_load(CONFIG.read_text())
    (app,) = cfg["applications"]
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    args = dict(app["args"])
    s = Settings.from_sources(file=args, env={})  # every key is a setting (extra="forbid")
    assert s.router == "prefix" and s.num_replicas == args["num_replicas"]
    built = builder({**args, "model_id": model_dir("tiny")})
    assert isinstance(built, Application)
    assert cfg["http_options"]["port"] == Settings().port
