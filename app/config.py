"""All settings in one pydantic model, filled from (highest first) CLI flags, ``RADIXSERVE_*``
environment variables, the Serve config file, and defaults. Engine settings keep TGI's names."""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import EngineConfig
from engine.model_loader import TOKENIZER_FILES

ENV_PREFIX = "RADIXSERVE_"
# RADIXSERVE_* variables that are not settings: the model folder's home, the batch command's default URL,
# the device the engine tests run on, the soak's length and clients
OTHER_ENV = frozenset({"RADIXSERVE_HOME", "RADIXSERVE_URL", "RADIXSERVE_TEST_DEVICE", "RADIXSERVE_SOAK_S",
                       "RADIXSERVE_SOAK_CLIENTS"})
DEVICE_PATTERN = r"^(auto|cpu|mps|xpu|cuda(:\d+)?)$"


class AutoscalingSettings(BaseModel):
    # JSON from a flag: "1" is a mistake, not a number; nor is inf or nan
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    # Serve's own default: the window of load averaged for each decision (Serve warns at 10 s or less,
    # its deprecated metrics interval, and says a later release will refuse it)
    look_back_period_s: float = Field(30.0, gt=10)
    # "cache": ours (deployments.autoscaling_policy): requests in flight, KV pressure, prefixes computed
    # again after their eviction, and no scaling down that would drop the working set; "requests": Serve's
    policy: Literal["cache", "requests"] = "cache"
    recompute_share: float = Field(0.1, gt=0, le=1)
    target_kv_usage: float = Field(0.8, gt=0, le=1)

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is more than max_replicas ({self.max_replicas})")
        unused = sorted({"recompute_share", "target_kv_usage"} & self.model_fields_set)
        if self.policy == "requests" and unused:
            raise ValueError(f"policy \"requests\" takes no {' or '.join(unused)} (settings of the cache policy)")
        return self


def tokenizer_fingerprint(model: str) -> str | None:
    """A short hash of a local model folder's tokenizer files; None for anything else (a hub id)."""
    folder = Path(model)
    digest, found = hashlib.blake2b(digest_size=6), False
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0")
            with path.open("rb") as f:
                for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest() if found else None


def api_keys(setting: str) -> list[str]:
    """The keys of the api_key setting: comma-separated, spaces around them left out."""
    return [k.strip() for k in setting.split(",")]


class Settings(BaseModel):
    # (inf parses as a float: a replica's inf CPUs or an inf timeout would fail later, in Ray or asyncio)
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    # model
    model_id: str | None = Field(None, description="local model folder; default: the built-in tiny model")
    served_model_name: str | None = Field(None, description="name clients pass as `model`; default: the folder's name "
                                   "(the built-in model: radixserve-tiny)")
    model_aliases: list[str] = Field([], description="other names clients may pass as `model`, comma-separated "
                                     "(e.g. the ones Claude Code sends); answers name the served model")
    # engine (TGI names)
    max_batch_prefill_tokens: int = Field(4096, gt=0)
    max_prefill_chunk_tokens: int = Field(512, gt=0, description="tokens of one prompt prefilled per step")
    max_batch_total_tokens: int | None = Field(None, gt=0, description="KV pool per replica, in tokens; default: "
                                               "kv_memory_fraction of the free device memory (CPU: at most 4 GiB)")
    max_input_tokens: int | None = Field(None, gt=0, description="longest prompt; default: max_total_tokens - 1")
    max_total_tokens: int | None = Field(None, gt=0, description="prompt + generated tokens; default: the "
                                         "model's context, or the KV pool's size if smaller")
    max_num_seqs: int = Field(256, gt=0)
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="which waiting request a replica admits first, and which running one gives way when "
        "its KV pool runs dry: fcfs (first come, first served) or priority (the OpenAI routes' `priority`, lower "
        "first, then arrival; vLLM's policy) (default: fcfs)")
    block_size: int = Field(16, gt=0)
    prefix_caching: bool = True
    window_size: int | None = Field(None, gt=0, description="sliding-window attention; default: the model's own")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3fn", "fp8_e5m2"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto (cuda when available), cpu, cuda, "
                        "cuda:N, mps or xpu")
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto"
    cuda_graphs: list[int] = Field([1, 2, 4, 8, 16, 32, 64, 128], description="steps run as CUDA graphs, by their "
                                   "tokens (a decode step has one per sequence), comma-separated (TGI's flag; 0: none; "
                                   "CUDA only; default: 1,2,4,8,16,32,64,128)")
    kv_memory_fraction: float = Field(0.3, gt=0, le=1)
    num_threads: int | None = Field(None, gt=0, description="torch threads per replica (CPU); default: "
                                    "--replica-num-cpus")
    seed: int = Field(0, ge=-(2**63), lt=2**64, description="the engine's random state at start (a 64-bit integer)")
    sampling_defaults: Literal["model", "api"] = Field("model", description="what the OpenAI routes use for "
                                                       "temperature, top_p, top_k, min_p, repetition_penalty and max_tokens "
                                                       "a request leaves unset: model (the model's generation_config.json, "
                                                       "as vLLM and SGLang) or api (OpenAI's own); "
                                                       "the TGI routes always keep TGI's (default: model)")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "none"] = Field(
        "hermes", description="how chat answers with tool_choice auto are read for tool calls: hermes "
        "(<tool_call>{...}</tool_call>: Qwen 2.5/3, Hermes), llama3_json (the answer is {\"name\": ..., "
        "\"parameters\": ...}: Llama 3.x), mistral ([TOOL_CALLS]...) or none (text only) (default: hermes)")
    reasoning_parser: Literal["none", "qwen3", "deepseek_r1"] = Field(
        "none", description="how chat answers of reasoning models are split into their thinking (the "
        "message's reasoning_content, a Responses reasoning item) and content: qwen3 (an answer that opens with "
        "<think> thinks until </think>), deepseek_r1 (the answer thinks from its start until </think>) or none "
        "(default: none)")
    # serving
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=1, le=65535, description="HTTP port, 1-65535 (with 0 Serve would listen on a port it cannot tell you)")
    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingSettings | None = None
    max_ongoing_requests: int = Field(64, gt=0)
    ingress_replicas: int = Field(1, ge=1, description="HTTP ingress replicas (tokenizing, routing); more than "
                                  "one keeps the service answering while one is replaced")
    # the HTTP ingress only forwards streams: Serve's default cap of 5 would queue the 6th client
    ingress_max_ongoing_requests: int = Field(4096, gt=0)
    engine_stall_timeout_s: float = Field(120.0, gt=0, description="a replica whose engine loop has not come "
                                          "round for this long fails its health check and is replaced")
    max_concurrent_requests: int | None = Field(
        None, gt=0, description="generation requests one ingress replica serves at once (a stream until its "
        "last byte); one more gets 429 'Model is overloaded' at once instead of waiting in line (TGI's flag; "
        "default: no limit)")
    payload_limit: int = Field(2_000_000, gt=0, description="largest request body in bytes (TGI's flag and "
                               "default: 2000000); bigger ones get 413 before they are read")
    api_key: str | None = Field(None, description="clients must send it as the header Authorization: "
                                "Bearer <key> on every route but /health and /metrics (as vLLM's and TGI's "
                                "--api-key); several keys comma-separated, any of them accepted, e.g. an old "
                                "and a new one while clients move (default: none, an open API)")
    cors_allow_origin: list[str] = Field([], description="origins whose web pages may call the API from a "
                                         "browser (CORS), comma-separated, e.g. https://app.example.com; * for "
                                         "any (TGI's flag; default: none)")
    replica_num_cpus: float = Field(1.0, ge=0)
    replica_num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (a share such as 0.5 too); default: 0, "
                                    "but `radixserve serve` starting a local Ray on a CUDA machine gives each "
                                    "replica its share of the GPUs (1 each, or 1/2, 1/3 ... with more replicas "
                                    "than GPUs)")
    router: Literal["prefix", "pow2", "round_robin"] = "prefix"
    routing_stats_period_s: float = Field(1.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0, description="Serve's proxy ends a request that takes longer "
                                     "(408, or a cut stream; `radixserve serve` only: a Serve config sets "
                                     "http_options.request_timeout_s)")
    # below Kubernetes' default grace period (30 s), which also has to cover deleting the application
    drain_timeout_s: float = Field(20.0, ge=0, description="on Ctrl-C or SIGTERM, how long requests in flight may "
                                   "take to finish while new ones get 503; also how long a replica that Serve "
                                   "removes (downscaling, redeploy) lets its streams finish (default: 20)")
    # hot-prefix directory
    redis_url: str | None = Field(None, description="hot-prefix directory (redis://, rediss://, unix://), or "
                                  "none to serve without one; default: a private redis-server started by "
                                  "`radixserve serve`")
    warmup_top_k: int = Field(16, ge=0)
    warmup_token_budget: int = Field(65536, ge=0)
    warmup_timeout_s: float = Field(300.0, gt=0, description="a starting replica that has not prefilled its hot "
                                    "prefixes within this many seconds starts with what it has (default: 300)")
    deployment_name: str = Field("radixserve", description="names the Serve application and its deployments (letters, digits, "
                                 "_ . -; default: radixserve)")

    @model_validator(mode="after")
    def _one_replica_count(self):
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas and autoscaling are both set: with autoscaling, min_replicas and "
                             "max_replicas decide the count")
        return self

    @field_validator("replica_num_gpus")
    @classmethod
    def _gpu_share_ray_counts(cls, v: float) -> float:
        if 0 < v < 0.0001:  # Ray counts resources in ten-thousandths
            raise ValueError("a GPU share must be 0 or at least 0.0001 (Ray's smallest fraction)")
        return v

    @field_validator("model_id")
    @classmethod
    def _absolute_folder(cls, v: str | None) -> str | None:
        # (where the settings are made: a replica reads them in a folder of its own, where ./model is not)
        return os.path.abspath(os.path.expanduser(v)) if v else v  # ("": the built-in model, as unset)

    @field_validator("api_key")
    @classmethod
    def _header_safe_key(cls, v: str | None) -> str | None:
        # it travels in a header: printable ASCII without spaces (the message leaves the key out)
        if v is not None and not all(re.fullmatch(r"[!-+\--~]+", k) for k in api_keys(v)):
            raise ValueError("each API key must be printable ASCII characters without spaces or commas "
                             "(several keys are comma-separated)")
        return v

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _batch_sizes(cls, v: Any) -> Any:
        if v is None:  # none, as a flag or variable says a setting's null: no graphs, as 0
            return []
        if isinstance(v, str):  # a flag or an environment variable: "1,2,4,8", or "0" for none
            items = [x.strip() for x in v.split(",")]
            if not all(x.isdigit() for x in items):
                raise ValueError(f"cuda_graphs must be comma-separated batch sizes (0 for none), got {v!r}")
            v = [int(x) for x in items]
        if isinstance(v, int) and not isinstance(v, bool):  # a config file's `cuda_graphs: 8` (or 0)
            v = [v]
        if isinstance(v, list) and any(isinstance(x, bool) for x in v):
            raise ValueError(f"cuda_graphs must list batch sizes, got {v}")
        if isinstance(v, list) and v == [0]:
            return []
        if isinstance(v, list) and any(not isinstance(x, int) or x <= 0 for x in v):
            raise ValueError(f"cuda_graphs must list positive batch sizes (or 0 for none), got {v}")
        return v

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _aliases(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):  # a flag or an environment variable: "claude-sonnet-4-5,claude-haiku-4-5"
            v = [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("cors_allow_origin", mode="before")
    @classmethod
    def _origins(cls, v: Any) -> Any:
        if v is None:  # RADIXSERVE_CORS_ALLOW_ORIGIN=none
            return []
        if isinstance(v, str):  # a flag or an environment variable: "https://a.example,https://b.example"
            v = [x.strip() for x in v.split(",") if x.strip()]
        if isinstance(v, list):
            v = [x.lower() if isinstance(x, str) else x for x in v]  # browsers send scheme and host in lower case
            for origin in v:
                # (a browser extension's pages too: extensions name their origin as any page does)
                if not isinstance(origin, str) or not (origin == "*" or re.fullmatch(
                        r"(https?|chrome-extension|moz-extension|safari-web-extension)://[^/\s]+", origin)):
                    raise ValueError(f"cors_allow_origin: {origin!r} is not an origin (scheme://host[:port], "
                                     "no path; or *)")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is None or v.lower() in ("none", "off"):
            return None if v is None else "none"
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix:// (or be none)")
        from redis.connection import parse_url

        try:  # here, not in every replica's start-up (which Serve would retry until it gives up)
            options = parse_url(v)
        except ValueError as e:  # not redis' words: they quote a part of the URL, which may be a password's
            what = "its port is not a number in 0-65535" if "port" in str(e).lower() else "it is malformed"
            raise ValueError(f"redis_url cannot be parsed: {what} (a / or @ in a password must be "
                             "percent-encoded: %2F, %40)") from None
        # an unencoded / in a password ends the host part there: parse_url takes what follows it for the
        # database (and ignores it), so every replica would look for Redis on a "host" made of the password
        if not v.startswith("unix://") and not re.fullmatch(r"(/\d*)?", urllib.parse.urlsplit(v).path):
            raise ValueError("redis_url: what follows the host must be a database number (/0); a / or @ in a "
                             "password must be percent-encoded: %2F, %40")
        # the directory reads and writes bytes: with answers decoded to text it failed once anything was
        # recorded, and every replica's start with it (Serve retried them for good)
        if refused := sorted({"decode_responses", "encoding", "encoding_errors"} & set(options)):
            raise ValueError(f"redis_url: the option {refused[0]} is not supported (the directory reads bytes)")
        return v

    @field_validator("deployment_name")
    @classmethod
    def _serve_name(cls, v: str) -> str:
        # Serve refuses some characters only when it deploys (after Ray has started); a Redis key and an
        # actor name are built from it too
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError(f"{v!r} is not a name: 1-64 letters, digits, _ . or -, starting with a letter or digit")
        return v

    def directory_url(self) -> str | None:
        """Where the hot-prefix directory lives; None: serving without one."""
        return None if self.redis_url == "none" else self.redis_url

    # ------------------------------------------------------------------ derived
    def resolved_model_id(self) -> str:
        if self.model_id:  # (absolute already: see _absolute_folder)
            return self.model_id
        from engine.model_init import ensure_default_model

        return str(ensure_default_model())

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        # (the absolute folder's name: `--model-id .` run inside the model's folder named it "")
        return Path(self.model_id).name if self.model_id else "radixserve-tiny"

    def cache_namespace(self) -> str:
        """What seeds the block hashes and names the hot-prefix directory's entries: the served name, and
        where the model is a local folder, a fingerprint of its tokenizer's files, so a model swapped
        under the same name does not warm up from (nor route by) the old one's token ids. Routers and
        replicas must agree: ``build_app`` computes it once and hands it to both."""
        fingerprint = tokenizer_fingerprint(self.resolved_model_id())
        return f"{self.model_name()}@{fingerprint}" if fingerprint else self.model_name()

    def engine_config(self, model_path: str | None = None, cache_namespace: str | None = None) -> EngineConfig:
        names = set(EngineConfig.field_names()) - {"model_id"}
        kw = {k: v for k, v in self.model_dump().items() if k in names}
        return EngineConfig(model_id=model_path or self.resolved_model_id(),
                            cache_namespace=cache_namespace or self.model_name(), **kw).validate()

    # ------------------------------------------------------------------ sources
    @classmethod
    def unknown_env(cls, env: Mapping[str, str]) -> list[str]:
        """The ``RADIXSERVE_*`` variables in ``env`` that nothing reads: typos, most likely."""
        return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in OTHER_ENV
                      and k[len(ENV_PREFIX):].lower() not in cls.model_fields)

    @classmethod
    def from_sources(cls, cli: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                     file: dict[str, Any] | None = None) -> Settings:
        """Merge the sources (CLI > environment > file > defaults); raise ``ValueError`` with every
        problem named."""
        env = os.environ if env is None else env
        if unknown := cls.unknown_env(env):  # a typo would be ignored, while the same one in a file is refused
            raise ValueError(f"unknown environment variable(s) {', '.join(unknown)}: the settings are "
                             f"{ENV_PREFIX}<NAME> for the names in `radixserve serve --help`")
        env_set = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                env_set[name] = _parse_env(name, raw)
        # a flag's text reads as a variable's does: `--api-key none` is no key, as RADIXSERVE_API_KEY=none is
        # (an unset flag is None: it leaves the sources below in charge)
        cli_set = {k: _parse_env(k, v) if isinstance(v, str) and v else v for k, v in (cli or {}).items()
                   if v is not None}
        merged: dict[str, Any] = {}
        for source in (dict(file or {}), env_set, cli_set):
            # a fixed count and autoscaling exclude each other: a source that sets one overrides the
            # other from the sources below it (setting both in one source is refused)
            # (a null autoscaling only turns it off: the count below it stands)
            for one, other in (("num_replicas", "autoscaling"), ("autoscaling", "num_replicas")):
                if source.get(one) is not None and other not in source:
                    merged.pop(other, None)
            merged.update(source)
        try:
            return cls(**merged)
        except ValidationError as e:
            raise ValueError(f"invalid settings: {'; '.join(_problem(err) for err in e.errors())}") from None


def _problem(err: dict) -> str:
    """One validation error as a user reads it: the setting, its flag, and pydantic's message without
    its "Value error, " or a repeat of the setting's name."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return msg
    name = ".".join(map(str, err["loc"]))
    if err.get("type") == "extra_forbidden":  # (a config file's key: there is no such flag to name)
        return f"{name}: no such setting (see `radixserve serve --help`; a flag --x-y is the setting x_y)"
    flag = f" (--{name.replace('_', '-')})" if len(err["loc"]) == 1 else ""
    return f"{name}{flag}: {msg.removeprefix(f'{name}: ')}"


def _parse_env(name: str, raw: str) -> Any:
    # none is the setting's null, unless it is one of the setting's own values (redis_url's none: no
    # directory; the parsers' none: no parser)
    if raw.lower() == "none" and name != "redis_url" and "none" not in _literal_values(name):
        return None
    if name == "autoscaling":
        import json

        try:
            return json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{ENV_PREFIX}AUTOSCALING is not JSON ({e}): {raw[:80]!r}") from None
    if raw.lower() == "null":
        return None
    return raw


def _literal_values(name: str) -> tuple:
    """The values a setting's ``Literal`` type allows (none for other types)."""
    import typing

    annotation = Settings.model_fields[name].annotation
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()  # pydantic coerces "8", "true", "0.5"
