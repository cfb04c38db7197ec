"""The GPU check: what a session lent a GPU machine measures, in one run of at most about 6 minutes.

Started by `scripts/gpu_check.sh` (which installs the carried wheels first). Each part is independent and records
its own error instead of ending the check:

1. the tiny recipes through `python -m launcher` on CUDA with NCCL (1 worker): step time, tokens/s, final hash;
2. a ~1B-parameter Llama from a config, in this process, bf16 autocast over fp32 weights, fused AdamW: step time,
   tokens/s, MFU against the chip's dense bf16 peak, peak memory; eager, then with each decoder block compiled;
3. NCCL abort and rebuild: a 1-rank group is aborted mid-job (as a survivor's is when a generation ends) and a new
   one built in the same process, which must then run a collective;
4. `fault=kill_worker` with NCCL where there are at least 2 GPUs (NCCL refuses two ranks on one GPU: said so where
   there is one), compared with the fault-free hash.

    python scripts/gpu_check.py --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
BF16_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peak by chip (NVIDIA's data sheets, SXM parts)."""
LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def launcher_run(run_dir: Path, *args: str, timeout_s: float = 150) -> dict:
    command = [sys.executable, "-m", "launcher", "cluster.backend=nccl", f"run.dir={run_dir}", "run.overwrite=true"]
    command += list(args)
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=timeout_s
    )
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    metrics_file = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    steady = [m for m in metrics if m["step"] > 3]
    return {
        "command": " ".join(command[1:]),
        "exit_code": done.returncode,
        "wall_s": time.perf_counter() - started,
        "status": summary.get("status"),
        "param_sha256": summary.get("param_sha256"),
        "median_step_s": sorted(m["step_s"] for m in steady)[len(steady) // 2] if steady else None,
        "median_tokens_per_s": sorted(m["tokens_per_s"] for m in steady)[len(steady) // 2] if steady else None,
        "recoveries": summary.get("recoveries"),
        "output_tail": (done.stdout + done.stderr)[-1500:],
    }


def tiny_recipes(out: Path) -> dict:
    common = ("cluster.nproc=1", "ft.spares=0", "trainer.max_steps=30", "trainer.print_every=1000")
    return {name: launcher_run(out / name, f"recipe={name}", *common) for name in ("tiny_llama", "tiny_gpt_oss")}


def llama_1b(*, compile_blocks: bool, steps: int = 8, batch: int = 4, seq_len: int = 2048) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(LLAMA_1B)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda()
    model.train()
    if compile_blocks:
        for block in model.model.layers:
            block.compile()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = torch.randint(0, config.vocab_size, (batch, seq_len + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=data[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    step_s = sorted(times[2:])[len(times[2:]) // 2]
    tokens_per_s = batch * seq_len / step_s
    name = torch.cuda.get_device_name()
    peak = next((flops for chip, flops in BF16_PEAK_FLOPS.items() if chip in name), None)
    flops_per_token = 6 * params + 12 * config.num_hidden_layers * config.hidden_size * seq_len
    result = {
        "params": params,
        "batch": f"{batch} x {seq_len}",
        "first_step_s": times[0],
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": loss.item(),
    }
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def nccl_abort_and_rebuild() -> dict:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # as a fault-tolerant worker sets it
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    torch.cuda.set_device(0)
    timings = {}
    for generation in (1, 2):
        started = time.perf_counter()
        dist.distributed_c10d._world.group_count = 0
        dist.init_process_group(
            "nccl",
            store=dist.PrefixStore(f"gen{generation}", store),
            rank=0,
            world_size=1,
            device_id=torch.device("cuda:0"),
        )
        value = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        timings[f"generation_{generation}_init_and_all_reduce_s"] = time.perf_counter() - started
        assert float(value[0]) == 1.0
        started = time.perf_counter()
        dist.distributed_c10d._get_default_group().abort()
        dist.destroy_process_group()
        timings[f"generation_{generation}_abort_s"] = time.perf_counter() - started
    return {"ok": True, **timings}


def kill_worker(out: Path, gpus: int) -> dict:
    if gpus < 2:
        return {"skipped": f"{gpus} GPU: NCCL refuses two ranks on one GPU, so a 2-worker NCCL job needs 2 GPUs"}
    common = ("recipe=tiny_llama", "cluster.nproc=2", "trainer.max_steps=24", "trainer.print_every=1000")
    reference = launcher_run(out / "reference", *common, "ft.spares=0")
    faulty = launcher_run(out / "kill", *common, "fault=kill_worker", "fault.rank=1", "fault.step=12")
    return {
        "reference": reference,
        "kill_worker": faulty,
        "hash_equal": reference["param_sha256"] == faulty["param_sha256"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu_check.json"))
    options = parser.parse_args()
    import torch

    runs = options.out.parent / "gpu_check_runs"
    gpus = torch.cuda.device_count()
    result: dict = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
    }
    parts = {
        "tiny_recipes": lambda: tiny_recipes(runs),
        "llama_1b_eager": lambda: llama_1b(compile_blocks=False),
        "llama_1b_compiled": lambda: llama_1b(compile_blocks=True),
        "nccl_abort_and_rebuild": nccl_abort_and_rebuild,
        "kill_worker": lambda: kill_worker(runs, gpus),
    }
    for name, part in parts.items():
        started = time.perf_counter()
        try:
            result[name] = part()
        except Exception as error:  # noqa: BLE001 - every part reports, the check goes on
            result[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        result[name]["part_s"] = time.perf_counter() - started if isinstance(result[name], dict) else None
        print(f"{name}: {json.dumps(result[name], default=str)[:600]}", flush=True)
        options.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
