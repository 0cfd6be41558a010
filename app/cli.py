"""The ``radixserve`` command line: ``serve``, ``init-model``, ``batch``."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
import typing

from app.config import Settings
from engine.presets import PRESETS

SERVE_FLAGS_SKIP = {"autoscaling"}


def _flag_type(annotation) -> tuple[type | None, list[str] | None]:
    """(argparse type, choices) for a settings field annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = args[0]
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base))
    if typing.get_origin(annotation) is list:  # comma-separated: the setting's validator splits it
        return str, None
    if base in (int, float) and type(None) in typing.get_args(annotation):
        return _nullable(base), None
    return (base if base in (int, float, str, bool) else str), None


def _nullable(base: type):
    """A number flag whose setting may be null: none or null pass through as text (``Settings.from_sources``
    reads them as the null, as it does a variable's), anything else must be a ``base``."""
    def parse(text: str):
        return text if text.lower() in ("none", "null") else base(text)
    parse.__name__ = base.__name__  # (argparse names the type in its error: "invalid int value")
    return parse


def _json_object(text: str) -> dict | str:
    """``--autoscaling``'s value (argparse would name ``json.loads`` in its error); none or null as they are
    (the setting's null: ``Settings.from_sources`` reads them)."""
    if text.lower() in ("none", "null"):
        return text
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'a JSON object, e.g. \'{{"min_replicas": 1, "max_replicas": 4}}\', not {text[:80]!r}')
    return value


class _Parser(argparse.ArgumentParser):
    """A mistaken flag gets its one line and where to look, not the whole usage (40 lines for serve)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting (TGI's names with dashes); unset flags do not override env/file."""
    for name, field in Settings.model_fields.items():
        if name in SERVE_FLAGS_SKIP:
            continue
        flag = "--" + name.replace("_", "-")
        typ, choices = _flag_type(field.annotation)
        help_ = field.description or ""
        if "default" not in help_:  # the setting's own default (the flag's is None: unset)
            help_ = f"{help_}{'; ' if help_ else ''}default: {field.default}"
        if typ is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            p.add_argument(flag, dest=name, type=typ, choices=choices, default=None, help=help_)
    p.add_argument("--autoscaling", dest="autoscaling", type=_json_object, default=None,
                   help='JSON, e.g. \'{"min_replicas": 1, "max_replicas": 4}\'')


def _init_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.model_init import write_model

    target = Path(args.path)
    if target.exists() and not target.is_dir():
        print(f"radixserve: {target} is a file, not a folder", file=sys.stderr)
        return 2
    if target.is_dir() and any(target.iterdir()) and not args.force:
        print(f"radixserve: {target} is not empty; pass --force to write the model over it", file=sys.stderr)
        return 2
    try:
        path = write_model(target, args.preset, seed=args.seed)
    except OSError as e:
        print(f"radixserve: cannot write {e.filename or target}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote the {args.preset} model to {path}")
    return 0


def preflight(settings: Settings, local_ray: bool) -> str | None:
    """What would make the service fail to start, found in seconds and before anything starts (the
    replicas would otherwise fail half a minute later, deep in Ray's logs): the engine settings, and
    when it starts a local Ray, the model folder, the limits against its context and the HTTP port."""
    # (joining a cluster: the model folder need only exist where replicas run)
    problem = settings_problem(settings, folder=local_ray, device=True)
    return problem or (_ray_here_problem() or _port_problem(settings) if local_ray else None)


def _ray_here_problem() -> str | None:
    """Without --address, ``ray.init`` joins the cluster that RAY_ADDRESS names or that `ray start` began on
    this machine (cluster.yaml's head node, a Ray job's driver), and then refuses the CPUs a local Ray is
    given, with a traceback: say which, and how to serve there."""
    if os.environ.get("RAY_ADDRESS", "local") != "local":  # ("local": start one, as Ray reads it)
        return (f"RAY_ADDRESS is set ({os.environ['RAY_ADDRESS']}): pass --address auto to serve on that cluster, "
                "or unset it to start a local Ray")
    try:
        from ray._private.services import find_bootstrap_address

        found = find_bootstrap_address(None)  # what `ray start` recorded (a cluster that ended clears it)
    except Exception:  # noqa: BLE001 - another Ray: ray.init says what it finds
        return None
    if found:
        return (f"a Ray cluster started with `ray start` runs on this machine ({found}): pass --address auto to "
                "serve on it, or stop it (`ray stop`) to start a local Ray")
    return None


def settings_problem(settings: Settings, folder: bool = True, device: bool = False) -> str | None:
    """What in the settings would fail every replica: the engine's checks; ``folder``: the model folder's
    too (the folder itself, the limits against its context and the KV pool, an fp8 cache's scales);
    ``device``: the device it would run on (where replicas run on this machine)."""
    from engine.config import ConfigError
    from engine.kv_scales import KVScaleError, read_kv_scales
    from engine.model_loader import ModelLoadError, check_model_folder, weight_files
    from engine.model_support import serving_limits

    try:
        engine = settings.engine_config()
        if not folder:
            return None
        path, config, _ = check_model_folder(settings.resolved_model_id())
        serving_limits(config, settings.max_input_tokens, settings.max_total_tokens, engine.pool_tokens())
        if settings.kv_cache_dtype.startswith("fp8"):  # a partial or broken set fails every replica's start
            read_kv_scales(weight_files(path), config.num_hidden_layers)
        return _device_problem(settings, config) if device else None
    except (ModelLoadError, ConfigError) as e:
        return str(e)
    except KVScaleError as e:
        return f"{settings.resolved_model_id()}: {e}"
    except OSError as e:  # the built-in model's folder (RADIXSERVE_HOME) cannot be written
        return f"cannot write the built-in model to {e.filename or 'its folder'}: {e.strerror or e}"


def _port_problem(settings: Settings) -> str | None:
    with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as s:
        # SO_REUSEADDR (as uvicorn sets) so a port in TIME_WAIT passes; no SO_REUSEPORT, so a live
        # listener, even another Serve proxy that would share the port with us, makes this fail
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((settings.host, settings.port))
        except OSError as e:
            hint = " (another service there?)" if e.errno == errno.EADDRINUSE else ""
            return f"cannot listen on {settings.host}:{settings.port}: {e.strerror}{hint}"
    return None


def _cluster_problem(settings: Settings) -> str | None:
    """With ``--address``: what on the cluster would make this start do other than it says. Serve has
    one HTTP port per cluster (a new one is ignored, with a warning in the logs only), and an
    application of the same name would be taken over (and deleted by this process's Ctrl-C)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # Serve starts here: its proxy on every node, this one too, takes the port
        return None if _ray_client() else _port_problem(settings)
    port = client.http_config.port
    if port != settings.port:
        return (f"Serve already runs on this cluster and listens on port {port}, not {settings.port}: "
                f"pass --port {port} (one HTTP port per cluster)")
    # nor its host and timeout (asked for explicitly; a default takes the cluster's own)
    http = client.http_config
    for name, there, same in (("host", http.host, _loopback(http.host) == _loopback(settings.host)),
                              ("request_timeout_s", http.request_timeout_s, http.request_timeout_s == settings.request_timeout_s)):
        if name in settings.model_fields_set and not same:
            flag = "--" + name.replace("_", "-")
            said = "no request timeout" if there is None else f"its {name} {there}"
            return (f"Serve already runs on this cluster with {said}, not {getattr(settings, name)}: "
                    f"leave out {flag} (Serve's HTTP options are the cluster's)")
    for name, app in (client.get_serve_details().get("applications") or {}).items():
        if name == settings.deployment_name or app.get("route_prefix") == "/":
            return (f"the application {name!r} already serves {app.get('route_prefix') or '/'} on this cluster "
                    "(another `radixserve serve`?): stop it first (Ctrl-C there, or `serve shutdown`)")
    return None


def _served_host(settings: Settings) -> str:
    """The host Serve's proxies listen on: a cluster whose Serve was already up keeps its own."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.http_config.host if client is not None else settings.host


def _loopback(host: str) -> str:
    """A host as Serve's proxy binds it: the loopback names alike."""
    return "loopback" if host in ("localhost", "127.0.0.1", "::1") else host


def _share_gpus(settings: Settings) -> Settings:
    """On its local Ray, replicas that will run on CUDA each take their share of the GPUs unless
    --replica-num-gpus says otherwise: with 0 (the setting's default, right for a CPU) Ray neither
    counts a GPU for them nor hides the others, so every replica loaded its model onto cuda:0."""
    if "replica_num_gpus" in settings.model_fields_set or settings.replica_num_gpus:
        return settings
    import torch

    from engine.model_loader import resolve_device

    try:
        if resolve_device(settings.device).type != "cuda":
            return settings
    except Exception:  # noqa: BLE001 - an unusable device: the preflight says why
        return settings
    # as many as may run (autoscaling's most: a local Ray has no nodes to add), each GPU split evenly
    # (Ray puts a fraction of a GPU on one GPU: 2 GPUs x 0.67 hold two replicas, not three)
    most = settings.autoscaling.max_replicas if settings.autoscaling else settings.num_replicas
    gpus = torch.cuda.device_count()
    share = 1 / math.ceil(most / gpus) if gpus else 1.0
    print(f"radixserve: each replica takes {share:.4g} GPU (--replica-num-gpus; {most} replica(s) at most, "
          f"{gpus} GPU(s) here)", file=sys.stderr)
    return settings.model_copy(update={"replica_num_gpus": share})


def gpus_hold(replicas: int, per_replica: float, gpus: int) -> bool:
    """Whether Ray can place ``replicas`` that each ask for ``per_replica`` GPUs on ``gpus`` GPUs: a
    fraction goes on one GPU (and Ray counts in ten-thousandths), more than one in whole GPUs."""
    if per_replica <= 0:
        return True
    if per_replica < 1:
        share = round(per_replica, 4)  # (under 0.0001 Ray refuses the fraction; the settings do too)
        return share > 0 and replicas <= gpus * math.floor(1 / share + 1e-9)
    return replicas * math.ceil(per_replica) <= gpus


def _device_problem(settings: Settings, config) -> str | None:
    """The device, attention backend and KV pool size asked for, on this machine (where a local Ray
    runs the replicas; ``config``: the model's)."""
    import torch

    from cache.kv_pool import bytes_per_token, num_blocks_for, pool_problem
    from engine.attention import flash_available
    from engine.model_loader import ModelLoadError, resolve_device, resolve_dtype
    from engine.model_support import head_dim, kv_heads

    try:
        device = resolve_device(settings.device)
    except ModelLoadError as e:  # this torch cannot use it here
        return str(e)
    except Exception as e:  # noqa: BLE001 - torch's own refusal of the name
        return f"device {settings.device!r}: {e}"
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        return f"device {settings.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    # Ray shows a replica only the GPUs it gives it, as cuda:0 on
    seen = max(1, math.ceil(settings.replica_num_gpus))
    if device.type == "cuda" and settings.replica_num_gpus and (device.index or 0) >= seen:
        return (f"device {settings.device!r}: each replica sees only its own {seen} GPU(s) "
                f"(--replica-num-gpus {settings.replica_num_gpus:g}), as cuda:0{f'-{seen - 1}' if seen > 1 else ''}: "
                "pass --device cuda (Ray picks the GPU), or --replica-num-gpus 0 for replicas that see every GPU "
                "(Ray then counts none for them)")
    # the replicas that start at once must find their GPUs here: Ray would leave them pending, and the
    # start-up would wait for them for good
    first = max(1, settings.autoscaling.min_replicas) if settings.autoscaling else settings.num_replicas
    if not gpus_hold(first, settings.replica_num_gpus, torch.cuda.device_count()):
        return (f"{first} replica(s) x --replica-num-gpus {settings.replica_num_gpus:.4g} do not fit on this "
                f"machine's {torch.cuda.device_count()} GPU(s) (Ray puts a fraction of a GPU on one GPU)")
    if settings.attention_backend == "flash" and not flash_available(device):
        return ("attention_backend flash needs a CUDA device and the vllm-flash-attn package, which pins "
                "torch 2.4, older than transformers 5 runs on: leave it to auto (SDPA)")
    # without a size the pool is sized from the free memory; on a GPU the replica checks (asking here
    # would leave a CUDA context in this process for as long as it serves)
    if settings.max_batch_total_tokens and device.type == "cpu":
        token_bytes = bytes_per_token(config.num_hidden_layers, kv_heads(config), head_dim(config),
                                      settings.kv_cache_dtype, resolve_dtype(settings.dtype, device))
        blocks = num_blocks_for(settings.block_size, token_bytes, settings.max_batch_total_tokens,
                                settings.kv_memory_fraction, device)  # (as the engine sizes and checks it)
        return pool_problem(blocks, settings.block_size, token_bytes, device, replicas=first)  # (all on this machine)
    return None


def _serve(args: argparse.Namespace) -> int:
    cli = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    try:
        settings = Settings.from_sources(cli=cli)
    except ValueError as e:
        print(f"radixserve: {e}", file=sys.stderr)
        return 2
    if not args.address:
        settings = _share_gpus(settings)
    problem = preflight(settings, local_ray=not args.address)
    if problem:
        print(f"radixserve: {problem}", file=sys.stderr)
        return 2
    if "max_num_seqs" in settings.model_fields_set and settings.max_num_seqs > settings.max_ongoing_requests:
        print(f"radixserve: warning: --max-num-seqs {settings.max_num_seqs} is more than a replica is sent at once "
              f"(--max-ongoing-requests {settings.max_ongoing_requests}): raise that too", file=sys.stderr)
    from app.local_redis import LocalRedis

    redis = None
    if settings.redis_url is None:
        try:
            # loopback only, but any local user could read the hot prompts from it: a password, kept
            # out of what is printed (the replicas get it in their settings)
            redis = LocalRedis(password=secrets.token_hex(16))
            settings = settings.model_copy(update={"redis_url": redis.url})
            print(f"started a local redis-server at {redis.shown_url}")
            if args.address:
                print("radixserve: warning: the local redis-server listens on this machine only: replicas on "
                      "other nodes serve without the hot-prefix directory; pass --redis-url (cluster.yaml "
                      "starts one on the head node's port 6380)", file=sys.stderr)
        except RuntimeError as e:
            print(f"radixserve: warning: {e}; serving without the hot-prefix directory", file=sys.stderr)
    try:
        return _run_serve(settings, args.address, redis)
    finally:
        if redis is not None:
            redis.stop()


class Flag:
    """A flag a signal handler may set: ``threading.Event.set`` takes a lock that the main thread may
    be holding inside ``Event.wait`` when the signal lands there, which would hang the process."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._set and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self._set


def _drain(settings: Settings, force: Flag) -> None:
    """New requests get 503 while those in flight finish (deleting the application at once would answer
    404 and cut every stream): until the ingress answers nothing and the live replicas run nothing for
    a few polls in a row, ``drain_timeout_s`` passes, or a second Ctrl-C."""
    import ray
    from ray import serve

    from deployments.ingress import DRAIN_LEASE_S
    from deployments.metrics import hub_name

    name = settings.deployment_name
    hub, hub_drains = None, False
    try:
        hub = ray.get_actor(hub_name(name), namespace="radixserve")
        ray.get(hub.drain.remote(DRAIN_LEASE_S), timeout=5)  # every ingress replica, at its next heartbeat
        hub_drains = True
    except Exception as e:  # noqa: BLE001 - the one the handle reaches still drains; the loop keeps asking
        print(f"radixserve: the metrics hub did not take the drain: {e}", file=sys.stderr)
    try:
        serve.get_deployment_handle(f"{name}-ingress", app_name=name).drain.remote().result(timeout_s=5)
    except Exception as e:  # noqa: BLE001
        # an ingress at its max_ongoing_requests queues the call: under the heaviest load, where the hub's
        # drain reaches them all the same; without either, nothing to drain (the app never came up)
        if not hub_drains:
            print(f"radixserve: not draining: {e}", file=sys.stderr)
            return
    deadline = time.monotonic() + settings.drain_timeout_s
    if _wait_idle(name, hub, deadline, force):
        return
    # what still runs ends now with an error event (a 503 before its first token), not with a
    # connection that closes when Ray stops: each replica hears it at its next push (every second)
    print("radixserve: ending the requests still running", file=sys.stderr, flush=True)
    try:
        hub = ray.get_actor(hub_name(name), namespace="radixserve")
        ray.get(hub.cut.remote(), timeout=5)
    except Exception as e:  # noqa: BLE001 - then Ray's stop cuts them
        print(f"radixserve: the metrics hub did not take the stop: {e}", file=sys.stderr)
        return
    _wait_idle(name, hub, time.monotonic() + 5, Flag(), ingress_only=True)  # (stopped replicas push no more)


def _wait_idle(name: str, hub, deadline: float, force: Flag, ingress_only: bool = False) -> bool:
    """Poll until nothing is in flight on the ingresses (and the replicas), for a few polls in a row
    (True), or until ``deadline`` or ``force`` (False)."""
    import ray

    from deployments.ingress import DRAIN_LEASE_S
    from deployments.metrics import hub_name

    idle = 0
    while time.monotonic() < deadline and not force.is_set():
        try:
            hub = hub or ray.get_actor(hub_name(name), namespace="radixserve")
            hub.drain.remote(DRAIN_LEASE_S)  # renewed: a drain outlives this process by one lease only
            busy = ray.get(hub.ingress_in_flight.remote(3.0), timeout=2)
            busy += 0 if ingress_only else ray.get(hub.busy.remote(3.0), timeout=2)
        except Exception:  # noqa: BLE001 - the hub is restarting: cannot tell, so wait (up to the deadline)
            hub, busy = None, 1
        idle = idle + 1 if busy == 0 else 0
        if idle >= 3:
            return True
        force.wait(0.5)
    return False


def _supervise_redis(redis) -> bool:
    """The private redis-server is this process's child: if it dies, start it again (replicas and
    routers reconnect on their own), rather than serve without the directory until the next restart.
    False once a restart failed: serving goes on without the directory (no retry every 2 s)."""
    try:
        if redis.restart_if_dead():
            print(f"radixserve: the local redis-server had stopped; restarted it at {redis.shown_url}",
                  file=sys.stderr, flush=True)
        return True
    except RuntimeError as e:
        print(f"radixserve: warning: cannot restart the local redis-server ({e}); serving goes on "
              "without the hot-prefix directory", file=sys.stderr, flush=True)
        return False


def _ray_went_with_us() -> int:
    print("radixserve: the local Ray stopped with this process (the signal went to its whole process group; "
          "under systemd use KillMode=mixed so that only radixserve gets it and drains): nothing to drain",
          file=sys.stderr, flush=True)
    return 1


_cleanup_signals = 0


def _during_cleanup(*_) -> None:
    """Signals while stopping: the first is ignored (the clean-up must finish, or Ray's processes leak);
    a second one gives up on it (a clean-up that hangs on an unreachable cluster)."""
    global _cleanup_signals
    _cleanup_signals += 1
    if _cleanup_signals >= 2:
        os.write(2, b"radixserve: stopping without finishing the clean-up\n")
        os._exit(130)
    os.write(2, b"radixserve: still stopping (once more to quit at once)\n")


def _gcs_answers(timeout: float = 1.0) -> bool:
    """False only when the local Ray's GCS refuses connections, twice (Ray's own calls would wait a
    minute for it); anything else, even an error of this check, counts as answering: a needless
    drain costs less than a skipped one."""
    import ray

    try:
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        address = (host.strip("[]"), int(port))  # an IPv6 address comes as [::1]:6379
    except Exception:  # noqa: BLE001 - cannot tell
        return True
    for attempt in range(2):
        try:
            with socket.create_connection(address, timeout=timeout):
                return True
        except ConnectionRefusedError:
            if attempt == 0:
                time.sleep(0.5)
        except OSError:
            return True
    return False


def _replicas(settings: Settings) -> str:
    a = settings.autoscaling
    if a is not None:
        return f"autoscaling {a.min_replicas}-{a.max_replicas} replicas ({a.policy} policy)"
    return f"{settings.num_replicas} replica(s)"


# "up" means a request gets answered: serve.run returns once the replicas are running, but the HTTP
# proxy learns the routes, and /health the replicas' first reports, a moment later (1-2 s were seen)
HEALTHY_AT_START_S = 30.0


def _ray_client() -> bool:
    """Joined through ``ray://``: this process is not on a node of the cluster."""
    import ray

    try:
        return bool(ray.util.client.ray.is_connected())
    except Exception:  # noqa: BLE001
        return False


def _proxy_here() -> bool:
    """Serve's HTTP proxy runs on this machine (so its port is this machine's to poll)."""
    import ray
    from ray import serve

    try:
        return not _ray_client() and ray.get_runtime_context().get_node_id() in serve.status().proxies
    except Exception:  # noqa: BLE001 - cannot tell
        return False


def _wait_healthy(host: str, port: int, within_s: float) -> bool:
    """Whether /health answers 200 within ``within_s`` at the host Serve's proxy listens on."""
    import httpx

    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/health"
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5, trust_env=False).status_code == 200:  # not via an HTTP_PROXY
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


def _deploy_failure(e: BaseException) -> str:
    """Serve's deploy failure in a line or two: its first line, and the replicas' own error where it names
    one (the last ``SomeError: ...`` line of the tracebacks it quotes)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
    cause = next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception): ", ln)), None)
    return lines[0] if cause is None or cause == lines[0] else f"{lines[0]} ({cause})"


def _run_serve(settings: Settings, address: str | None, redis=None) -> int:
    import ray
    from ray import serve

    from app.main import build_app
    from deployments.metrics import hub_name

    up, stop, force, interrupted = Flag(), Flag(), Flag(), Flag()

    def on_signal(*_) -> None:
        if not up.is_set():
            interrupted.set()
            raise KeyboardInterrupt  # still starting: give up the start-up (the finally below cleans up)
        (force if stop.is_set() else stop).set()  # the first drains, a second skips the rest of the drain

    def take_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    take_signals()
    code, ray_gone, deployed = 0, False, False
    try:
        if address:
            try:
                ray.init(address=address, namespace="radixserve", logging_level=logging.WARNING)
            except Exception as e:  # noqa: BLE001 - no cluster there, a wrong address: a message, not a traceback
                print(f"radixserve: cannot join the Ray cluster at {address}: {e}", file=sys.stderr)
                return 2
            if problem := _cluster_problem(settings):
                print(f"radixserve: {problem}", file=sys.stderr)
                return 2
        else:
            most = settings.autoscaling.max_replicas if settings.autoscaling else settings.num_replicas
            need = most * settings.replica_num_cpus + 1  # logical CPUs: every LLM replica must fit
            ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False,
                     namespace="radixserve", logging_level=logging.WARNING)
        take_signals()  # a local Ray node puts in a SIGTERM handler that exits at once: SIGTERM drains too
        serve.start(http_options={"host": settings.host, "port": settings.port,
                                  "request_timeout_s": settings.request_timeout_s})
        deployed = True  # (from here on the hub is this application's own, to remove at the end)
        try:
            serve.run(build_app(settings), name=settings.deployment_name, route_prefix="/", blocking=False)
        except RuntimeError as e:  # DEPLOY_FAILED: its replicas kept failing to start (their log lines are above)
            if interrupted.is_set():
                raise KeyboardInterrupt from None
            print(f"radixserve: the service failed to start: {_deploy_failure(e)}", file=sys.stderr, flush=True)
            return 1
        take_signals()
        if interrupted.is_set():  # Ray caught the interrupt and went on: give up the start-up all the same
            raise KeyboardInterrupt
        here = not address or _proxy_here()  # else the proxies are on the cluster's other machines
        host = _served_host(settings) if address else settings.host
        healthy = _wait_healthy(host, settings.port, HEALTHY_AT_START_S) if here else True
        up.set()
        host = f"[{host}]" if ":" in host else host  # (an IPv6 address)
        print(f"RadixServe is up: http://{host if here else '<a node of the cluster>'}:{settings.port} "
              f"(model {settings.model_name()}, {_replicas(settings)}); Ctrl-C stops it"
              + ("" if healthy else f" (/health did not answer 200 within {HEALTHY_AT_START_S:.0f} s: "
                                    "see the replicas' lines above)"), flush=True)
        while not stop.wait(2.0):
            if redis is not None and not _supervise_redis(redis):
                redis = None
        # a SIGTERM to the whole process group (systemd's default KillMode, `timeout`) also stops the
        # local Ray's processes, which are in it: there is nothing left to drain, and every call to Ray
        # would wait a minute for its GCS. It may still answer for a moment as it goes (seen on a busy
        # machine), so the drain runs aside while this thread keeps asking.
        if not address and not _gcs_answers():
            ray_gone = True
            return _ray_went_with_us()
        print(f"shutting down: finishing the requests in flight (up to {settings.drain_timeout_s:.0f} s; "
              "Ctrl-C again skips the wait)...", flush=True)
        draining = threading.Thread(target=_drain, args=(settings, force), name="drain", daemon=True)
        draining.start()
        while draining.is_alive():
            draining.join(1.0)
            if draining.is_alive() and not address and not _gcs_answers():
                ray_gone = True
                return _ray_went_with_us()
        if address:  # a cluster we joined keeps running (other applications too): take ours off it
            # without waiting: streams that outlived the drain get the replicas' own grace period
            # (drain_timeout_s again) from the cluster, not from this process's shutdown budget
            serve.delete(settings.deployment_name, _blocking=False)
        # our own local cluster simply stops (ray.shutdown below): nothing is in flight any more, and
        # deleting the application first would have Serve's proxy answer 404 for a few seconds, which
        # load balancers take as an answer; a closed port they take as a server that is gone
    except BaseException as e:
        if not (isinstance(e, KeyboardInterrupt) or (interrupted.is_set() and not up.is_set())):
            raise
        # (Ray may turn an interrupt inside its start-up into an error of its own)
        print("radixserve: interrupted while starting; stopping", file=sys.stderr, flush=True)
        code = 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the clean-up must finish, or Ray's processes leak
            signal.signal(sig, _during_cleanup)
        if address and deployed and not up.is_set() and not ray_gone:
            # a start-up that failed or was interrupted on a cluster we joined: ours comes off it (it kept
            # its replicas, and a new `radixserve serve` there was refused as "already serves")
            try:
                serve.delete(settings.deployment_name, _blocking=False)
            except Exception:  # noqa: BLE001 - the cluster is going: nothing left to take off
                pass
        if deployed and not ray_gone:
            try:
                ray.kill(ray.get_actor(hub_name(settings.deployment_name), namespace="radixserve"))
            except Exception:  # noqa: BLE001 - already gone
                pass
        ray.shutdown()
    print("stopped", flush=True)
    return code


PRESET_NAMES = list(PRESETS)


def build_parser() -> argparse.ArgumentParser:
    # no abbreviated flags (--num-replica for --num-replicas): a script that used one would change meaning
    # when a new flag made it ambiguous, and the environment and config files refuse such typos too
    ap = _Parser(prog="radixserve", description="Prefix-aware LLM serving on Ray Serve.", allow_abbrev=False)
    ap.add_argument("--version", action="version", version=f"radixserve {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # no ArgumentDefaultsHelpFormatter: flags default to None (unset flags leave the environment and
    # the config file in charge), so each flag's help names the setting's own default instead
    s = sub.add_parser("serve", help="start Ray (or join one), Redis and the HTTP service", allow_abbrev=False)
    s.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    add_settings_flags(s)
    s.set_defaults(func=_serve)
    p = sub.add_parser("init-model", allow_abbrev=False, help="write a small random-weight model of any supported architecture "
                                          "(Llama, Mistral, Qwen, Gemma, Phi, OLMo, Mixtral and more) with a "
                                          "byte-level tokenizer")
    p.add_argument("path", help="folder to write (created if missing)")
    p.add_argument("--preset", default="tiny", choices=PRESET_NAMES,
                   help="tiny: the built-in model; bench: the benchmarks' 57M-parameter Llama; bench-1b: a 0.85B-parameter "
                        "Llama for GPU benchmarks (3.4 GB); tiny-ARCH: a small model of each supported architecture "
                        "(engine/presets.py; default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="of the random weights (default: 0)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p.set_defaults(func=_init_model)
    b = sub.add_parser("batch", help="run a JSONL file of requests through a running service (`ray job submit`)",
                       allow_abbrev=False,
                       description="Requests that share a prefix are sent back to back; a rerun continues.")
    from app import batch

    batch.add_arguments(b)
    b.set_defaults(func=batch.main)
    return ap


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, which points to its own --help
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    # until a command takes signals over (loading torch and Ray takes seconds), SIGTERM stops it as
    # Ctrl-C does, so the clean-up (a private redis-server) still runs
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("radixserve: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
