"""`accelerate launch --config_file examples/accelerate/tp2_one_node.yaml examples/tp_generate.py`
starts 2 processes on this CPU machine (gloo) and prints the text a single process prints."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO
from tiny_models import save_tiny

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tp_generate.py"
CONFIG = ROOT / "examples" / "accelerate" / "tp2_one_node.yaml"
PROMPT = "w5 w6 w7 w8"


def _single_process_text(folder: str) -> str:
    spec = importlib.util.spec_from_file_location("tp_generate", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, tokenizer = example.load(folder, 1)
    inputs = example.inputs_for(tokenizer, PROMPT)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=32, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.multiprocess
def test_accelerate_launch_two_processes_same_text(tmp_path_factory):
    folder = save_tiny(tmp_path_factory, "llama")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
           "--config_file", str(CONFIG), "--main_process_port", "0", str(EXAMPLE),
           "--model", folder, PROMPT]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[rank 0 of 2] tp_size=2" in proc.stderr and "[rank 1 of 2] tp_size=2" in proc.stderr
    text = proc.stdout.strip().splitlines()[-1]
    assert text == _single_process_text(folder).strip()
    assert len(text.split()) >= 16  # a real generation, not an empty string
