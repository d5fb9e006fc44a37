"""The policies hdr builds itself, offline: a tiny Llama on a byte-level BPE trained on the
embedded corpus (the fast bed) and a tiny random Qwen2 on Qwen2.5's real tokenizer (the
fidelity bed), saved with `save_pretrained` so they load like any real model (`hdr
init-model`). Above agent_env (its prompts and tags shape the tokenizer), below the trainer."""
