"""Run in a subprocess by test_offload_budget.py: load a checkpoint with an offload budget,
generate, and print the peak RSS above the baseline taken after imports and warm-up."""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_dsinfer  # noqa: F401
from hf_dsinfer.offload import attach, schedule  # noqa: F401  (imports before the baseline)


def rss(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(ln for ln in status if ln.startswith(field))
    return int(line.split()[1]) * 1024


def warm_up(path: str) -> None:
    """Import what loading and generating import (the model's modeling file, generation
    utilities), on a 1-layer copy of the config: imports are not the model's memory."""
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers, config.vocab_size = 1, 8
    tiny = AutoModelForCausalLM.from_config(config)
    tiny.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=2, do_sample=False)


def main() -> None:
    path, policy = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    warm_up(path)
    base = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak (VmHWM) to the current RSS
    model = AutoModelForCausalLM.from_pretrained(path, dsinfer={"offload": policy,
                                                                "parity_check": False})
    loaded = rss("VmHWM") - base
    ids = torch.randint(3, 500, (4, 32))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                         do_sample=False)
    print(json.dumps({"peak_above_base": rss("VmHWM") - base, "tokens": out.shape[1],
                      "peak_at_load": loaded}))


if __name__ == "__main__":
    main()
