"""The shipped Serve config builds the application (``serve run`` / ``serve deploy`` take it as is)."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest
import yaml

from app.config import Settings

CONFIG = Path(__file__).resolve().parents[2] / "serve_config.yaml"


def test_serve_config_args_are_valid_settings_and_build_the_app(model_dir, monkeypatch, caplog):
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
    for misplaced in ({"port": 9001}, {"host": "0.0.0.0", "request_timeout_s": 5}):  # http_options, not args
        with pytest.raises(ValueError, match="invalid settings: .* would do nothing: in a Serve config they are "
                           "http_options"):
            builder({**args, **misplaced})
    monkeypatch.setenv("RADIXSERVE_PORT", "9001")  # left from `radixserve serve`: builds, and says it is ignored
    with caplog.at_level("WARNING", logger="radixserve"):
        assert isinstance(builder({**args, "model_id": model_dir("tiny")}), Application)
    assert "RADIXSERVE_PORT ignored" in caplog.text
    monkeypatch.delenv("RADIXSERVE_PORT")
    with pytest.raises(ValueError, match="num_replica: no such setting") as e:  # a typo: no flag to name
        builder({**args, "num_replica": 3})
    assert "--num-replica" not in str(e.value)


def test_replicas_and_the_ingress_get_the_drain_timeout_and_the_autoscaling_window(model_dir):
    from app.main import build_app, llm_deployment

    s = Settings(model_id=model_dir("tiny"), drain_timeout_s=45,
                 autoscaling={"min_replicas": 1, "max_replicas": 3, "look_back_period_s": 12})
    cfg = llm_deployment(s)._deployment_config
    assert cfg.graceful_shutdown_timeout_s == 45  # a replica that autoscaling removes finishes its streams
    # and so does an ingress being replaced (it relays those streams)
    assert build_app(s)._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 45
    assert cfg.autoscaling_config.look_back_period_s == 12 and cfg.autoscaling_config.max_replicas == 3


def test_a_redeploy_keeps_the_fleet_autoscaling_grew(model_dir):
    """Serve sets the target to initial_replicas whenever the deployment's config or version changes:
    named always, a redeploy (a raised max_replicas, a rolling update) dropped 6 replicas to min_replicas.
    Serve's own registration (no Ray started) is fed what llm_deployment builds."""
    from ray.serve._private.autoscaling_state import DeploymentAutoscalingState
    from ray.serve._private.common import DeploymentID

    from app.main import llm_deployment

    class Info(types.SimpleNamespace):  # what register() reads of a DeploymentInfo
        def config_changed(self, other):
            return self.deployment_config != other.deployment_config or self.version != other.version

    def info(min_replicas: int, max_replicas: int, version: str) -> Info:
        s = Settings(model_id=model_dir("tiny"), autoscaling={"min_replicas": min_replicas, "max_replicas": max_replicas})
        return Info(deployment_config=llm_deployment(s)._deployment_config, version=version, target_capacity=None,
                    target_capacity_direction=None)

    for min_replicas, first, after in ((2, 2, 6), (0, 1, 1)):  # (min 0 starts one, and so does a redeploy: README)
        state = DeploymentAutoscalingState(DeploymentID(name="radixserve-llm", app_name="radixserve"))
        assert state.register(info(min_replicas, 8, "v1"), 0) == first
        # autoscaling grew the fleet to 6; the operator raises max_replicas, then rolls out new settings
        assert state.register(info(min_replicas, 10, "v1"), 6) == after
        assert state.register(info(min_replicas, 10, "v2"), 6) == after


def test_the_cache_aware_autoscaling_policy_is_the_default_and_serves_can_be_chosen(model_dir):
    from ray.serve.config import AutoscalingPolicy

    from app.main import llm_deployment
    from deployments.autoscaling_policy import CacheAwarePolicy

    s = Settings(model_id=model_dir("tiny"), autoscaling={"max_replicas": 3, "recompute_share": 0.2})
    policy = llm_deployment(s)._deployment_config.autoscaling_config.policy
    assert policy.policy_function == "deployments.autoscaling_policy:CacheAwarePolicy"
    assert policy.policy_kwargs == {"recompute_share": 0.2, "target_kv_usage": 0.8}
    assert isinstance(policy.get_policy()(**policy.policy_kwargs), CacheAwarePolicy)  # what Serve's controller does
    s = Settings(model_id=model_dir("tiny"), autoscaling={"max_replicas": 3, "policy": "requests"})
    assert llm_deployment(s)._deployment_config.autoscaling_config.policy == AutoscalingPolicy()
    for bad in ({"policy": "queue"}, {"recompute_share": 0}, {"target_kv_usage": 1.5},
                {"recompute_share": 0.2, "policy": "requests"}):  # a knob the chosen policy ignores
        with pytest.raises(ValueError, match=next(iter(bad))):
            Settings.from_sources(file={"autoscaling": bad}, env={})


def test_a_look_back_window_serve_would_refuse_is_a_settings_error():
    with pytest.raises(ValueError, match="look_back_period_s"):
        Settings.from_sources(file={"autoscaling": {"look_back_period_s": 5}}, env={})


def test_autoscaling_numbers_must_be_numbers():
    with pytest.raises(ValueError, match="min_replicas"):
        Settings.from_sources(file={"autoscaling": {"min_replicas": "1"}}, env={})
    a = Settings.from_sources(file={"autoscaling": {"max_replicas": 2, "target_ongoing_requests": 1}}, env={})
    assert a.autoscaling.target_ongoing_requests == 1.0  # an integer where a float goes is fine
    # inf parsed as a float: --replica-num-gpus inf raised OverflowError building the deployment
    for field, value in (("replica_num_gpus", "inf"), ("replica_num_cpus", "nan"), ("request_timeout_s", "inf")):
        with pytest.raises(ValueError, match=field):
            Settings.from_sources(cli={field: value}, env={})
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        Settings.from_sources(file={"autoscaling": {"target_ongoing_requests": float("inf")}}, env={})


def test_a_replica_count_and_autoscaling_follow_the_sources_precedence():
    # serve_config.yaml sets num_replicas: autoscaling from the environment (or a flag) replaces it
    s = Settings.from_sources(file={"num_replicas": 2}, env={"RADIXSERVE_AUTOSCALING": '{"max_replicas": 3}'})
    assert s.autoscaling.max_replicas == 3 and "num_replicas" not in s.model_fields_set
    s = Settings.from_sources(cli={"num_replicas": 4}, env={"RADIXSERVE_AUTOSCALING": '{"max_replicas": 3}'})
    assert s.autoscaling is None and s.num_replicas == 4
    with pytest.raises(ValueError, match="both set"):  # one source saying both is a mistake
        Settings.from_sources(file={"num_replicas": 2, "autoscaling": {"max_replicas": 3}}, env={})
    # a null autoscaling only turns it off: the count from below stands (it used to fall back to 1)
    assert Settings.from_sources(cli={"autoscaling": "none"}, env={"RADIXSERVE_NUM_REPLICAS": "3"}).num_replicas == 3
    s = Settings.from_sources(file={"num_replicas": 2}, env={"RADIXSERVE_AUTOSCALING": "null"})
    assert s.num_replicas == 2 and s.autoscaling is None
    with pytest.raises(ValueError, match="RADIXSERVE_NUM_REPLICA"):  # a typo is not ignored
        Settings.from_sources(env={"RADIXSERVE_NUM_REPLICA": "2"})
    Settings.from_sources(env={"RADIXSERVE_HOME": "/tmp", "RADIXSERVE_URL": "x"})  # not settings, not typos


def test_cuda_graph_sizes_come_as_tgi_takes_them():
    """``--cuda-graphs 1,2,4`` (a flag or RADIXSERVE_CUDA_GRAPHS), 0 for none, a list in a config file."""
    assert Settings.from_sources(cli={"cuda_graphs": "1,2,4"}).engine_config("m").cuda_graphs == (1, 2, 4)
    assert Settings.from_sources(env={"RADIXSERVE_CUDA_GRAPHS": "0"}).engine_config("m").cuda_graphs == ()
    assert Settings.from_sources(file={"cuda_graphs": [8, 16]}).cuda_graphs == [8, 16]
    assert Settings().engine_config("m").cuda_graphs == (1, 2, 4, 8, 16, 32, 64, 128)
    assert Settings.from_sources(file={"cuda_graphs": 0}).cuda_graphs == []
    assert Settings.from_sources(file={"cuda_graphs": 8}).cuda_graphs == [8]
    assert Settings.from_sources(cli={"cuda_graphs": " 1, 2"}).cuda_graphs == [1, 2]
    for source in ({"cli": {"cuda_graphs": "none"}}, {"env": {"RADIXSERVE_CUDA_GRAPHS": "null"}}):
        assert Settings.from_sources(**source).cuda_graphs == []  # (a setting's null: "should be a valid list")
    for bad in ("1,x", "-2", [0, 4], "", ",", "1,,2", "1,2,", "1.5", [True]):
        with pytest.raises(ValueError, match="cuda_graphs"):
            Settings.from_sources(cli={"cuda_graphs": bad})
    from app.cli import build_parser

    for flag, sizes in (("1,2,4", (1, 2, 4)), ("0", ()), ("8", (8,))):  # through the command line itself
        args = build_parser().parse_args(["serve", "--cuda-graphs", flag])
        cli = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
        assert Settings.from_sources(cli=cli, env={}).engine_config("m").cuda_graphs == sizes


def test_cors_origins_come_comma_separated_and_must_be_origins():
    from app.cli import build_parser

    args = build_parser().parse_args(["serve", "--cors-allow-origin", "https://app.example, http://localhost:3000"])
    cli = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    assert Settings.from_sources(cli=cli, env={}).cors_allow_origin == ["https://app.example", "http://localhost:3000"]
    assert Settings.from_sources(env={"RADIXSERVE_CORS_ALLOW_ORIGIN": "*"}).cors_allow_origin == ["*"]
    assert Settings().cors_allow_origin == []
    assert Settings.from_sources(env={"RADIXSERVE_CORS_ALLOW_ORIGIN": "none"}).cors_allow_origin == []
    assert Settings.from_sources(cli={"cors_allow_origin": "HTTPS://App.Example"}, env={}).cors_allow_origin == [
        "https://app.example"]
    ext = "chrome-extension://abcdefghijklmnopabcdefghijklmnop"  # (an extension's pages name their origin too)
    assert Settings.from_sources(cli={"cors_allow_origin": ext}, env={}).cors_allow_origin == [ext]
    for bad in ("https://app.example/", "app.example", "ftp://x.example", ["https://a.example", 3]):
        with pytest.raises(ValueError, match="is not an origin"):
            Settings.from_sources(cli={"cors_allow_origin": bad}, env={})


def test_a_redis_url_is_parsed_up_front_and_none_turns_the_directory_off():
    for off in ("none", "NONE", "off"):
        s = Settings.from_sources(env={"RADIXSERVE_REDIS_URL": off})
        assert s.redis_url == "none" and s.directory_url() is None
        assert build_app_args(s)["redis_url"] is None  # the routers get no directory either
    assert Settings().redis_url is None  # unset: `radixserve serve` starts a private one
    assert Settings(redis_url="redis://h:6380/0").directory_url() == "redis://h:6380/0"
    assert Settings.from_sources(env={"RADIXSERVE_REDIS_URL": "null"}).redis_url is None  # as for every setting
    for bad, said in (("redis://:s3cr/et@127.0.0.1:6380/0", "percent-encoded"), ("redis://h:99999", "not a number"),
                      ("redis://:s3cr@et/more@127.0.0.1:6380/0", "percent-encoded"),  # (parsed: host "et")
                      ("http://h:6379", "must start with"),
                      ("redis://h:6380/0?decode_responses=True", "decode_responses is not supported")):
        with pytest.raises(ValueError, match=said) as e:
            Settings.from_sources(cli={"redis_url": bad}, env={})
        assert "s3cr" not in str(e.value)  # no part of a password is repeated into logs


def build_app_args(settings: Settings) -> dict:
    from app.main import request_router_config

    return request_router_config(settings).request_router_kwargs


def test_a_deployment_name_serve_and_redis_can_use_is_checked_up_front():
    for bad in ("a#b", "", "a b", "-x", "x" * 65, "a/b"):
        with pytest.raises(ValueError, match="is not a name"):
            Settings.from_sources(cli={"deployment_name": bad}, env={})
    assert Settings(deployment_name="chat-v2.1_b").deployment_name == "chat-v2.1_b"


def test_the_port_is_one_a_client_can_be_told():
    # with 0, Serve's proxy listened on a port the OS picked, and the "is up" line said :0
    for bad in (0, -1, 65536):
        with pytest.raises(ValueError, match=r"port \(--port\)"):
            Settings.from_sources(cli={"port": bad}, env={})
    assert Settings.from_sources(cli={"port": 1}, env={}).port == 1


def test_replicas_and_routers_hash_in_one_namespace_that_changes_with_the_tokenizer(model_dir, tmp_path):
    # the directory's entries and the block hashes were named by the served name alone: a model swapped
    # under the same name warmed its replicas up from the old tokenizer's ids (for up to an hour)
    import shutil

    from app.config import tokenizer_fingerprint
    from app.main import build_app

    tiny = model_dir("tiny")
    copy = tmp_path / "tiny"
    shutil.copytree(tiny, copy)
    assert tokenizer_fingerprint(str(copy)) == tokenizer_fingerprint(tiny) is not None
    spec = copy / "tokenizer.json"
    spec.write_text(spec.read_text().replace('"<|eos|>"', '"<|end|>"', 1))  # another tokenizer
    assert tokenizer_fingerprint(str(copy)) != tokenizer_fingerprint(tiny)
    assert tokenizer_fingerprint("org/some-hub-id") is None and tokenizer_fingerprint(str(tmp_path)) is None
    s = Settings(model_id=tiny, served_model_name="chat")
    namespace = s.cache_namespace()
    assert namespace == f"chat@{tokenizer_fingerprint(tiny)}"
    assert Settings(model_id=str(copy), served_model_name="chat").cache_namespace() != namespace
    ingress = build_app(s)._bound_deployment
    llm = ingress.init_args[0]._bound_deployment  # the LLM replicas' deployment, bound into the ingress
    assert llm.init_args[1] == namespace  # the replicas' engines and directory client
    assert llm._deployment_config.request_router_config.request_router_kwargs["model_id"] == namespace


def test_flags_are_never_abbreviated_and_read_none_as_variables_do():
    # argparse took --num-replica for --num-replicas (and --max-in for --max-input-tokens), where the
    # environment and config files refuse typos; `--api-key none` was a key spelt "none", while
    # RADIXSERVE_API_KEY=none is an open API
    from app.cli import build_parser

    for command in (["serve", "--num-replica", "2"], ["batch", "--input", "a", "--output", "b", "--concur", "2"]):
        args, extra = build_parser().parse_known_args(command)  # (main refuses what is left over)
        assert extra == command[-2:]
    args, _ = build_parser().parse_known_args(["serve", "--api-key", "none", "--cors-allow-origin", "None",
                                               "--reasoning-parser", "none", "--autoscaling", "none"])
    cli = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    s = Settings.from_sources(cli=cli, env={"RADIXSERVE_API_KEY": "from-env", "RADIXSERVE_REASONING_PARSER": "qwen3",
                                            "RADIXSERVE_AUTOSCALING": '{"max_replicas": 2}'})
    assert s.api_key is None and s.cors_allow_origin == []  # (the flag's none overrides the variable)
    assert s.reasoning_parser == "none" and s.autoscaling is None  # (a parser's none is its own value)
    assert Settings.from_sources(env={"RADIXSERVE_TOOL_CALL_PARSER": "none"}).tool_call_parser == "none"
    assert Settings.from_sources(cli={"redis_url": "none"}, env={}).redis_url == "none"  # (no directory)
    assert Settings.from_sources(env={"RADIXSERVE_AUTOSCALING": "none"}).autoscaling is None  # was "not JSON"
    # number flags whose setting may be null take none too (they were "invalid int value: 'none'")
    args, _ = build_parser().parse_known_args(["serve", "--max-total-tokens", "none", "--window-size", "NULL",
                                               "--max-batch-total-tokens", "8192", "--num-threads", "none"])
    cli = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    s = Settings.from_sources(cli=cli, env={"RADIXSERVE_MAX_TOTAL_TOKENS": "2048", "RADIXSERVE_WINDOW_SIZE": "64"})
    assert s.max_total_tokens is None and s.window_size is None and s.num_threads is None
    assert s.max_batch_total_tokens == 8192
    with pytest.raises(SystemExit):  # anything else must still be a number
        build_parser().parse_known_args(["serve", "--max-total-tokens", "lots"])
    with pytest.raises(ValueError, match="at least 0.0001"):  # (the GPU check divided by zero)
        Settings.from_sources(cli={"replica_num_gpus": 1e-9}, env={})
    for bad, said in (({"host": ""}, "host (--host): String should have at least 1 character"),
                      ({"seed": 2**64}, "seed (--seed): Input should be less than")):  # (each replica failed)
        with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
            Settings.from_sources(cli=bad, env={})


def test_api_keys_come_comma_separated_and_a_refusal_does_not_quote_them():
    from app.config import api_keys

    assert api_keys(Settings(api_key="old-key, new-key").api_key) == ["old-key", "new-key"]
    for bad in ("zq zq", "zq,,zq", "zq,", "zqé", ""):
        with pytest.raises(ValueError, match="without spaces or commas") as e:
            Settings.from_sources(cli={"api_key": bad}, env={})
        assert "zq" not in str(e.value), str(e.value)


def test_a_serve_config_the_engine_would_refuse_is_refused_when_it_is_built(model_dir, tmp_path):
    # `radixserve serve` checks these before it starts; a Serve config's app built, and every replica failed
    from app.main import app_builder

    for args, said in (({"max_input_tokens": 100, "max_total_tokens": 50}, "must be below max_total_tokens"),
                       ({"max_batch_total_tokens": 8}, "at least one block"),
                       ({"max_batch_total_tokens": 1024, "max_total_tokens": 4096}, "more than the KV pool holds")):
        with pytest.raises(ValueError, match=f"invalid settings: .*{said}"):
            app_builder({"model_id": model_dir("tiny"), **args})
    # the model folder's checks too, where it is here (they were made in each replica only)
    with pytest.raises(ValueError, match="invalid settings: .*max_total_tokens"):
        app_builder({"model_id": model_dir("tiny"), "max_total_tokens": 9000, "max_batch_total_tokens": 16384})
    with pytest.raises(ValueError, match="invalid settings: .*has no config.json"):
        app_builder({"model_id": str(tmp_path)})
    app_builder({"model_id": str(tmp_path / "on-the-workers")})  # (a folder that may exist where replicas run)



def test_a_leftover_port_variable_is_ignored_under_a_serve_config_not_checked(model_dir, monkeypatch, caplog):
    # ignored with a warning, yet still parsed: RADIXSERVE_PORT=abc failed a deploy where Serve's http_options
    # say where it listens
    from app.main import app_builder

    monkeypatch.setenv("RADIXSERVE_PORT", "abc")
    monkeypatch.setenv("RADIXSERVE_REQUEST_TIMEOUT_S", "-1")
    app_builder({"model_id": model_dir("tiny")})
    assert "RADIXSERVE_PORT, RADIXSERVE_REQUEST_TIMEOUT_S ignored" in caplog.text


def test_a_failed_deploy_is_said_in_a_line_with_the_replicas_error():
    # serve.run's RuntimeError (replicas that kept failing to start) ended `radixserve serve` in a traceback
    from app.cli import _deploy_failure

    quoted = ("Deploying application radixserve failed: Failed to update the deployments ['radixserve-llm'].\n"
              "Traceback (most recent call last):\n  File \"llm_server.py\", line 80, in __init__\n"
              "ray.exceptions.RayTaskError(ValueError): ray::ServeReplica:radixserve.initialize()\n"
              "ValueError: the model's weights are missing lm_head.weight\n")
    assert _deploy_failure(RuntimeError(quoted)) == ("Deploying application radixserve failed: Failed to update the "
                                                     "deployments ['radixserve-llm']. (ValueError: the model's weights "
                                                     "are missing lm_head.weight)")
    assert _deploy_failure(RuntimeError("")) == "RuntimeError"


def test_the_cluster_launcher_installs_into_a_venv_its_commands_find():
    # Ubuntu 24.04's system pip refuses installs (PEP 668); Ray's launcher runs every command in an
    # interactive login shell, which puts what ~/.bashrc adds on the PATH
    cluster = yaml.safe_load((CONFIG.parent / "cluster.yaml").read_text())
    setup = cluster["setup_commands"]
    assert not any("pip install" in c and "radixserve-venv/bin/pip install" not in c for c in setup), setup
    assert any("radixserve-venv/bin:$PATH" in c and ".bashrc" in c for c in setup), setup
    mount = next(iter(cluster["file_mounts"]))
    assert mount == f"/home/{cluster['auth']['ssh_user']}/radixserve", mount  # (each `cd radixserve` is from ~)


def test_the_cluster_launcher_config_is_valid_and_its_nodes_are_ready_for_many_streams():
    """Ray's schema takes it; its start commands raise the open-file limit Ray's own defaults raise (each
    client stream holds one at a node's Serve proxy: ~1,000 at the stock limit); apt waits for a fresh
    instance's lock and asks nothing (needrestart's dialog hung the launcher's ssh session)."""
    import json

    import jsonschema
    import ray

    cluster = yaml.safe_load((CONFIG.parent / "cluster.yaml").read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(cluster)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cluster[key] if "ray start" in c]
        assert starts and all(c.startswith("ulimit -n 65536;") for c in starts), starts
    apt = [c for c in cluster["setup_commands"] if "apt-get" in c or "$APT" in c]
    assert all("$APT" in c for c in apt if "apt-get" not in c) and all("sudo apt-get" not in c for c in apt), apt
    defined = next(c for c in cluster["setup_commands"] if c.startswith("echo 'APT="))
    assert "DEBIAN_FRONTEND=noninteractive" in defined and "DPkg::Lock::Timeout" in defined


def test_a_relative_model_folder_is_the_one_beside_the_command(monkeypatch, tmp_path):
    # replicas start in folders of their own: `--model-id ./model` was looked for there
    import os

    monkeypatch.chdir(tmp_path)
    assert Settings.from_sources(cli={"model_id": "./model"}).model_id == str(tmp_path / "model")
    assert Settings.from_sources(env={"RADIXSERVE_MODEL_ID": "~/m"}).model_id == os.path.expanduser("~/m")
    assert Settings(model_id="").resolved_model_id() == Settings().resolved_model_id()  # ("": the built-in one)


def test_a_cpu_pool_past_the_free_memory_is_refused_before_start_up():
    # the start-up check sizes the pool as the engine allocates it: its blocks and the padding block
    from app.cli import settings_problem

    assert "max_batch_total_tokens" in settings_problem(Settings(max_batch_total_tokens=10**9), device=True)
    assert settings_problem(Settings(max_batch_total_tokens=4096), device=True) is None
