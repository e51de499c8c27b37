"""Run by vLLM's own Python (not the project's) from tests/test_vllm_engine.py: vLLM in
process (`LLM.generate`), with the routing as `RequestOutput.outputs[0].routed_experts`
hands it over. Writes what came back to an .npz (no pickles) and a JSON of the Python types.

usage: python _vllm_offline.py MODEL_DIR OUT_PREFIX PROMPTS_JSON MAX_TOKENS [EXTRA_ARGS_JSON]

EXTRA_ARGS_JSON: a JSON list of (prompt index, SamplingParams.extra_args) run as further
requests after the prompts (route injection sent to this engine, whose replay_ops plugin is
not turned on).
"""
import json
import sys

import numpy as np


def main() -> None:
    model, out, prompts_json, max_tokens = sys.argv[1:5]
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []
    from vllm import LLM, SamplingParams

    prompts = json.loads(prompts_json)
    llm = LLM(model=model, dtype="bfloat16", max_model_len=256, seed=0, enforce_eager=True,
              enable_return_routed_experts=True, enable_prefix_caching=True)
    params = [SamplingParams(max_tokens=int(max_tokens), min_tokens=int(max_tokens),
                             ignore_eos=True, seed=i, logprobs=0) for i in range(len(prompts))]
    params += [SamplingParams(max_tokens=int(max_tokens), min_tokens=int(max_tokens),
                              ignore_eos=True, seed=i, logprobs=0, extra_args=args)
               for i, args in extra]
    prompts = prompts + [prompts[i] for i, _ in extra]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    arrays, types = {}, []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        r = c.routed_experts
        types.append({"type": f"{type(r).__module__}.{type(r).__name__}",
                      "dtype": str(getattr(r, "dtype", None)),
                      "prompt_token_ids": list(o.prompt_token_ids),
                      "token_ids": list(c.token_ids),
                      "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
        arrays[f"routed_{i}"] = np.asarray(r)
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump(types, f)


if __name__ == "__main__":
    main()
