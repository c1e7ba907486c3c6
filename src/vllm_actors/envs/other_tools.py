"""Variables of other tools (CUDA, Triton, vLLM, prometheus_client) that the package reads too
(group ``other``)."""

from __future__ import annotations

from vllm_actors.envs.parsers import text
from vllm_actors.envs.setting import Setting, switch


class OtherTools:
    """The ``other`` group's settings (``Envs`` inherits them)."""

    TRITON_INTERPRET = switch(
        "Triton's: kernels run in its interpreter (the CPU tests); read when kernels import.", "other", default=False)
    CUDA_VISIBLE_DEVICES = Setting[str | None](
        None, text, "CUDA's: an empty value hides every GPU (busy polling then stays off on `auto`).",
        kind="str", group="other", keep_empty=True)
    VLLM_API_KEY = Setting[str | None](
        None, text, "vLLM's: the API key the server requires where `--api-key` is not given.",
        kind="str", group="other")
    VLLM_SERVER_DEV_MODE = switch(
        "vLLM's: the server's development endpoints (`/server_info`, `/reset_prefix_cache`, `/sleep`, "
        "`/wake_up`, `/is_sleeping`) are registered.", "other", default=False)
    VLLM_PP_LAYER_PARTITION = Setting[str | None](
        None, text, "vLLM's: the layers of each pipeline stage, comma-separated (`10,14`: 10 on the first stage); "
        "unset, an even split (the first stages take one more where it does not divide).", kind="str", group="other")
    VLLM_ALLOW_RUNTIME_LORA_UPDATING = switch(
        "vLLM's: the server's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` endpoints are registered.",
        "other", default=False)
    VLLM_TORCH_PROFILER_DIR = Setting[str | None](
        None, text, "vLLM's: the workers run torch.profiler between `POST /start_profile` and `/stop_profile` "
        "(registered only then) and write the trace here.", kind="path", group="other")
    PROMETHEUS_MULTIPROC_DIR = Setting[str | None](
        None, text, "prometheus_client's: set by `serve --api-server-count` above 1, histograms shared there.",
        kind="path", group="other")
