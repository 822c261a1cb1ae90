"""A real vLLM engine in its own process, driven by JSON lines (test helper).

Usage: python engine_driver.py '<json settings>' (model, kv_role,
extra_config, reply_fd, and optional llm_kwargs passed on to `vllm.LLM` and
connector, false for an engine without one).
Reads one command per line on stdin and answers each with one JSON line on
the inherited file descriptor `reply_fd`. Commands:

- {"op": "generate", "prompts": [[ids...], ...], "max_tokens": n, "salt": s|null}
  -> {"outputs": [{"token_ids": [...], "logprobs": [...]}, ...]}; with "top_logprobs": k
  each output also has "top": per step the k most likely [token, logprob] pairs
- {"op": "reset_prefix_cache"} -> {"ok": bool}
- {"op": "metrics"} -> {"metrics": {name: value}} (vLLM's counters and gauges; those
  labelled with a source also as "name[source]")
- {"op": "exit"}

Separate processes keep every engine independent of the test process (which
kills and restarts the kvdepot server) and of each other.
"""

import json
import os
import sys
import time

_replies = sys.stdout


def _reply(payload: dict) -> None:
    _replies.write(json.dumps(payload) + "\n")
    _replies.flush()


def main() -> None:
    global _replies
    settings = json.loads(sys.argv[1])
    # Replies get a pipe of their own: vLLM's processes log to stdout and
    # stderr, and their lines can interleave with anything written there.
    _replies = os.fdopen(settings["reply_fd"], "w")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = KVTransferConfig(
        kv_connector="KVDepotConnector",
        kv_connector_module_path="kvdepot.integrations.vllm",
        kv_role=settings.get("kv_role", "kv_both"),
        kv_connector_extra_config=settings["extra_config"],
    )
    options = {
        "skip_tokenizer_init": True,
        "seed": 0,
        "block_size": 128,
        "max_model_len": 4096,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        # vLLM on CPU would run bfloat16; float32 makes the cold and the
        # cache-hit runs bit-identical, so any wrong KV block shows.
        "dtype": "float32",
    } | settings.get("llm_kwargs", {})
    if isinstance(options.get("kv_events_config"), dict):  # JSON brings a dict
        options["kv_events_config"] = KVEventsConfig(**options["kv_events_config"])
    # "connector": false runs the engine without any KV connector: the reference an engine
    # that kvdepot refuses to serve must match.
    connected = settings.get("connector", True)
    llm = LLM(model=settings["model"], kv_transfer_config=transfer if connected else None,
              **options)
    _reply({"ready": True})

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "metrics":
            # Counters and gauges only (needs disable_log_stats=False), summed
            # by name, and by name and source for those labelled with one.
            values: dict[str, float] = {}
            for metric in llm.get_metrics():
                if isinstance(getattr(metric, "value", None), int | float):
                    values[metric.name] = values.get(metric.name, 0) + metric.value
                    source = (getattr(metric, "labels", None) or {}).get("source")
                    if source is not None:
                        key = f"{metric.name}[{source}]"
                        values[key] = values.get(key, 0) + metric.value
            _reply({"metrics": values})
            continue
        if cmd["op"] == "reset_prefix_cache":
            # Blocks of a finished request stay held until its stores are
            # done, and vLLM refuses to reset while any block is in use.
            deadline = time.monotonic() + 30
            while not (ok := bool(llm.reset_prefix_cache())) and time.monotonic() < deadline:
                time.sleep(0.05)
            _reply({"ok": ok})
            continue
        # "top_logprobs": k also returns each step's k most likely tokens (a hit must
        # match the cold run on the whole distribution's head, not the sampled token only).
        top = int(cmd.get("top_logprobs", 0))
        params = SamplingParams(
            temperature=0.0, max_tokens=cmd["max_tokens"], logprobs=top, detokenize=False
        )
        prompts = []
        for ids in cmd["prompts"]:
            prompt = TokensPrompt(prompt_token_ids=ids)
            if cmd.get("salt") is not None:
                prompt["cache_salt"] = cmd["salt"]
            prompts.append(prompt)
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs = []
        for result in results:
            completion = result.outputs[0]
            logprobs = [
                step[token].logprob
                for step, token in zip(completion.logprobs or [], completion.token_ids, strict=True)
            ]
            output = {"token_ids": list(completion.token_ids), "logprobs": logprobs}
            if top:
                output["top"] = [sorted(([t, lp.logprob] for t, lp in step.items()
                                         if lp.rank is not None and lp.rank <= top),
                                        key=lambda pair: (-pair[1], pair[0]))
                                 for step in completion.logprobs or []]
            outputs.append(output)
        _reply({"outputs": outputs})


if __name__ == "__main__":
    main()
