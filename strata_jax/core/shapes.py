"""The shape-suffix legend: one meaning per letter across strata_jax.

Array names end in `_` + one letter per axis, e.g. `k_LBSKDh` is [layers, batch rows, cache positions,
kv heads, head dim]. `1` is an axis of size one kept for broadcasting. Arbitrary leading axes (`...`)
are never named.

Model and serving:
  B   batch rows (sequences in one step)
  T   tokens per row in one step (a power-of-two bucket)
  N   tokens of a step flattened (B * T), or steps of a decode chunk
  S   cache positions (what attention reads)
  Sr  cache positions of one read of a streamed KV leaf (model/kvquant.py StreamedKV)
  L   layers (of the model, or those sharing one expert pool's cache)
  M   MoE layers
  E   experts of a MoE layer
  X   expert slots (rows of a device pool)
  k   experts routed per token
  U   distinct experts requested in one access (the policy's lookups), -1 padded
  C   groups of the dense prefill's scan, J experts per group
  K   kv heads
  H   query heads
  G   query heads per kv head (H // K)
  Dh  head dim
  Do  per-head value dims, what each head outputs (Dh, but where the values are narrower: deepseek2)
  D   model dim
  F   ffn dim (dense, shared or routed expert)
  V   vocab
  W   repeat-penalty window
  Vw  words of a vocab bitmask (32 tokens per 32-bit word, bit t % 32 of word t // 32: llguidance's)
  St  stop token ids (-1 padded)
  R   row bytes of one GGML matrix (its quantized last axis)
  P   bytes of one expert row (gate, up and down rows back to back: core/experts.py)

Cache policies, the trace simulator and the routing model (offload/policies.py, simulate.py, routing.py):
  Ac  accesses of a cache (one per token and layer: a = t * L + l)
  Tc  tokens of one block of pre-drawn routing noise
  Xn  cache sizes scored at once (slots per layer)
  Pf  coordinates of a fitted model (unconstrained)

qwen4exp (hyper-connections: model/layers/hyper.py; gated DeltaNet: model/layers/deltanet.py;
QSA: model/layers/qsa.py; PLE: model/layers/ple.py):
  Hc  hyper-connection residual streams (hc_count)
  r   hyper-connection low rank
  Hk  linear-attention key heads
  Hv  linear-attention value heads (value head h reads key head h % Hk)
  Dk  linear-attention key head dim
  Dv  linear-attention value head dim
  Kc  taps of a short (causal depthwise) convolution, or its state length (past inputs it keeps)
  Cc  channels of a short convolution
  Sb  QSA compressed key blocks (compress_ratio cache positions each)
  Rc  positions of one QSA block (compress_ratio): the indexer's ring of its latest raw keys
  Hi  QSA indexer query heads
  Di  QSA indexer head dim
  Gp  PLE n-gram hash heads (table rows gathered per token)

deepseek2 (multi-head latent attention: model/layers/mla.py; its cache is one key "head" of Dh = Rk + Dr):
  Rq  query latent rank (q_lora_rank)
  Rk  key/value latent rank (kv_lora_rank)
  Dn  per-head key dims without rope
  Dr  rotated key dims (one rope key shared by every head)

Inside a GGML row (gguf/quant.py's decoders, the qmatvec kernel):
  Y   blocks in a row (n_cols // block size)
  A   sub-blocks (or groups of them) of a super-block (K-quant, IQ)
  e   grid points of an IQ block or sub-block (each a lattice point standing for 4 or 8 values)
  Q   values in one block, sub-block or grid point
  Z   bytes of one field (the axis a field's bytes are unpacked or bitcast along)
  I   (matrix, token rows) pairs of one qmatvec call
  O   output rows of one kernel program
"""
