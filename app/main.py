"""Builds the Serve application from ``Settings``: LLM replicas behind the HTTP ingress.

``serve run app.main:app_builder`` / ``serve deploy serve_config.yaml`` call ``app_builder`` with the
config file's ``args``; ``radixserve serve`` calls ``build_app`` directly.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from app.config import ENV_PREFIX, Settings
from deployments.ingress import Ingress
from deployments.llm_server import LLMServer


def llm_deployment(settings: Settings, cache_namespace: str | None = None):
    """The LLM replicas' deployment; ``cache_namespace``: ``Settings.cache_namespace``, computed once (its
    routers must hash as its replicas do)."""
    opts: dict[str, Any] = dict(
        name=f"{settings.deployment_name}-llm",
        max_ongoing_requests=settings.max_ongoing_requests,
        ray_actor_options={"num_cpus": settings.replica_num_cpus, "num_gpus": settings.replica_num_gpus},
        health_check_period_s=5,
        health_check_timeout_s=10,  # Serve's 30 s, three times over, left a frozen replica in service for minutes
        # a replica that autoscaling removes first lets its streams finish (Serve stops sending it new ones)
        graceful_shutdown_timeout_s=settings.drain_timeout_s,
    )
    if settings.autoscaling is not None:
        a = settings.autoscaling
        extra = {}
        if a.policy == "cache":
            extra["policy"] = AutoscalingPolicy(
                policy_function="deployments.autoscaling_policy:CacheAwarePolicy",
                policy_kwargs={"recompute_share": a.recompute_share, "target_kv_usage": a.target_kv_usage})
        opts["autoscaling_config"] = AutoscalingConfig(
            # Serve sets the fleet to initial_replicas on every redeploy that changes the deployment, so it is
            # named only where the start needs it (min 0: one replica to begin with); else a redeploy
            # dropped a grown fleet, its caches with it, to min_replicas
            min_replicas=a.min_replicas, max_replicas=a.max_replicas, initial_replicas=1 if a.min_replicas == 0 else None,
            target_ongoing_requests=a.target_ongoing_requests, upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s, look_back_period_s=a.look_back_period_s, **extra)
    else:
        opts["num_replicas"] = settings.num_replicas
    opts["request_router_config"] = request_router_config(settings, cache_namespace)
    return serve.deployment(LLMServer).options(**opts)


def request_router_config(settings: Settings, cache_namespace: str | None = None):
    """Serve's request router for the LLM deployment: ours (``prefix``, ``round_robin``) or Serve's
    default power-of-two-choices (``pow2``), hashing prompts in ``cache_namespace`` (default: the served
    name, as the replicas' own default)."""
    from ray.serve.config import RequestRouterConfig

    period = settings.routing_stats_period_s
    if settings.router == "pow2":
        return RequestRouterConfig(request_routing_stats_period_s=period)
    return RequestRouterConfig(
        request_router_class="routing.prefix_router:PrefixAwareRequestRouter",
        request_router_kwargs={"mode": settings.router, "block_size": settings.block_size,
                               "model_id": cache_namespace or settings.model_name(),
                               "redis_url": settings.directory_url(),
                               "deployment": settings.deployment_name},
        request_routing_stats_period_s=period)


# settings only the HTTP ingress reads
INGRESS_ONLY = frozenset({"api_key", "sampling_defaults", "cors_allow_origin", "payload_limit", "tool_call_parser",
                          "max_concurrent_requests"})


def build_app(settings: Settings):
    settings.resolved_model_id()  # create the built-in model before replicas look for it
    namespace = settings.cache_namespace()  # once, here: replicas and routers hash in it alike
    # Replica counts stay out of the replicas' own arguments: changing them through the Python API then
    # scales the deployment in place instead of replacing every replica (`serve deploy` hashes a config
    # file's whole `args`, so there any change restarts every replica).
    s = settings.model_dump(exclude={"num_replicas", "autoscaling", "ingress_replicas"})
    # nor do the ingress' own settings go to the LLM replicas: a new API key would restart every one of them
    llm = llm_deployment(settings, namespace).bind({k: v for k, v in s.items() if k not in INGRESS_ONLY}, namespace)
    return Ingress.options(name=f"{settings.deployment_name}-ingress", num_replicas=settings.ingress_replicas,
                           max_ongoing_requests=settings.ingress_max_ongoing_requests,
                           # as the LLM replicas: a frozen ingress is every request's outage, and one
                           # being replaced lets the streams it relays finish
                           health_check_period_s=5, health_check_timeout_s=10,
                           graceful_shutdown_timeout_s=settings.drain_timeout_s).bind(
        llm, s, scales_to_zero=settings.autoscaling is not None and settings.autoscaling.min_replicas == 0)


# where Serve listens is the Serve config's own http_options, not the application's: taken as args,
# they would be accepted and do nothing
HTTP_OPTIONS = frozenset({"host", "port", "request_timeout_s"})


def app_builder(args: dict[str, Any]):
    """Entry point for ``serve run`` / ``serve deploy`` (``args`` from the Serve config file)."""
    misplaced = sorted(HTTP_OPTIONS & dict(args or {}).keys())
    if misplaced:
        raise ValueError(f"invalid settings: {', '.join(misplaced)} under args would do nothing: in a Serve "
                         "config they are http_options, set beside applications")
    ignored = sorted(ENV_PREFIX + name.upper() for name in HTTP_OPTIONS if os.environ.get(ENV_PREFIX + name.upper()))
    if ignored:  # a variable left from `radixserve serve`: not an error, but it must not look obeyed
        logging.getLogger("radixserve").warning(
            "%s ignored: under a Serve config, where Serve listens is its http_options", ", ".join(ignored))
    # (not read either: a leftover RADIXSERVE_PORT=abc failed the deploy it has no say in)
    env = {k: v for k, v in os.environ.items() if k not in {ENV_PREFIX + name.upper() for name in HTTP_OPTIONS}}
    settings = Settings.from_sources(env=env, file=dict(args or {}))
    from app.cli import settings_problem

    # the engine's own checks (`radixserve serve` makes them before it starts), else each replica fails; the
    # model folder's where it is here too (on a cluster it may exist only where replicas run)
    folder = settings.model_id is None or Path(settings.resolved_model_id()).is_dir()
    if problem := settings_problem(settings, folder=folder):
        raise ValueError(f"invalid settings: {problem}")
    return build_app(settings)
