"""Deprecated aliases of engine arguments (group ``alias``; ``engine_args`` reads them where the
argument is not given)."""

from __future__ import annotations

from vllm_actors.envs.parsers import integer
from vllm_actors.envs.setting import Setting, switch


class DeprecatedAliases:
    """The ``alias`` group's settings (``Envs`` inherits them)."""

    VLLM_ACTORS_STEPS_IN_FLIGHT = Setting(
        2, integer(1), "Deprecated: the engine argument `steps_in_flight`.", kind="int", group="alias")
    VLLM_ACTORS_DISABLE_EVENTS = switch("Deprecated: the engine argument `disable_events`.", "alias", default=False)
    VLLM_ACTORS_CHECK_INVARIANTS = switch("Deprecated: the engine argument `check_invariants`.", "alias", default=False)
