"""FlexGen-style offloading for HF models: placement policy, cost model + LP search, weight and
KV stores on device / CPU / disk, the block schedule with overlapped I/O, 4-bit compression.

    model = AutoModelForCausalLM.from_pretrained(path, dsinfer={"offload": {
        "weights": (0, 40, 60), "cache": (0, 100, 0), "offload_dir": "/tmp/offload",
        "memory": "2.5GiB", "micro_batch_size": 8, "num_micro_batches": 4}})
    policy = hf_dsinfer.offload.plan(path, prompt_len=512, gen_len=32, memory="2.5GiB")

Light imports only here (DSInferConfig imports the policy); the engine loads on first use.
"""

from hf_dsinfer.errors import OffloadBudgetError, OffloadFileError
from hf_dsinfer.offload.policy import OffloadPolicy

_LAZY = {"attach_offload": "attach", "detach_offload": "attach", "get_engine": "attach",
         "plan": "search"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"hf_dsinfer.offload.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'hf_dsinfer.offload' has no attribute {name!r}")


__all__ = ["OffloadBudgetError", "OffloadFileError", "OffloadPolicy", "attach_offload",
           "detach_offload", "get_engine", "plan"]
