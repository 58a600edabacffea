"""PyTorch reference implementation of karpathy/minGPT's GPT model.

Reference generator for burnscale's minGPT port; never run by CI.

The model is a faithful transcription of `mingpt/model.py` from
https://github.com/karpathy/minGPT (commit 37baab71b9abea1b76ab957409a1cc2fbfba8a26):
same module tree (so `named_parameters()` yields the GPT-2 / HF key names
directly), same init, same op order in the forward pass. Differences that do
not change numerics:
  * the config is a dataclass instead of minGPT's CfgNode (no `model_type`),
  * the MLP forward is a method instead of a lambda (lambdas break deepcopy),
  * no parameter-count print in __init__, no `from_pretrained` / `generate`.

It also provides safetensors save/load in the HF GPT-2 key layout, where the
Conv1D weights (c_attn, c_proj, c_fc) are stored as [in_features, out_features],
i.e. transposed with respect to torch.nn.Linear's [out_features, in_features].
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1

    def to_dict(self) -> dict:
        return asdict(self)


class NewGELU(nn.Module):
    """GELU, tanh approximation (as in OpenAI GPT / BERT)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # q, k, v projections for all heads in one fused Linear; output split in q, k, v order
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        # Non-persistent so it never appears in state_dict (HF / the fixture do not carry it).
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, 1, config.block_size, config.block_size
            ),
            persistent=False,
        )
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # merge heads side by side

        y = self.resid_dropout(self.c_proj(y))
        return y


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        # ModuleDict (not a custom module) so parameter names are mlp.c_fc.* / mlp.c_proj.* as in HF.
        self.mlp = nn.ModuleDict(
            dict(
                c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
                c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
                act=NewGELU(),
                dropout=nn.Dropout(config.resid_pdrop),
            )
        )

    def mlpf(self, x):
        m = self.mlp
        return m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.embd_pdrop),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),  # eps 1e-5 (torch default)
            )
        )
        # Separate (untied) output head, no bias.
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        # Init as minGPT: module-wise init, then the GPT-2 scaled init for residual projections.
        # NOTE: the order of RNG draws matters for reproducing minGPT bit-for-bit under a seed.
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            torch.nn.init.zeros_(module.bias)
            torch.nn.init.ones_(module.weight)

    def num_params(self, include_lm_head: bool = True) -> int:
        # minGPT's own printout excludes lm_head ("decoder parameters").
        n = sum(p.numel() for p in self.parameters())
        if not include_lm_head:
            n -= self.lm_head.weight.numel()
        return n

    def configure_optimizers(self, learning_rate: float, betas, weight_decay: float):
        """AdamW with minGPT's parameter grouping: weight decay only on nn.Linear weights;
        biases, LayerNorm and Embedding weights get none."""
        decay, no_decay = set(), set()
        for mn, m in self.named_modules():
            for pn, _ in m.named_parameters(recurse=False):
                fpn = f"{mn}.{pn}" if mn else pn
                if pn.endswith("bias"):
                    no_decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, nn.Linear):
                    decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, (nn.LayerNorm, nn.Embedding)):
                    no_decay.add(fpn)
        param_dict = dict(self.named_parameters())
        assert not (decay & no_decay)
        assert not (param_dict.keys() - (decay | no_decay))
        groups = [
            {"params": [param_dict[pn] for pn in sorted(decay)], "weight_decay": weight_decay},
            {"params": [param_dict[pn] for pn in sorted(no_decay)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.block_size, f"sequence length {t} > block size {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)  # (1, t)

        tok_emb = self.transformer.wte(idx)  # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (1, t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)

        loss = None
        if targets is not None:
            # Targets are used as given (the caller shifts them); -1 entries are ignored.
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# ---------------------------------------------------------------------------
# HF GPT-2 layout (de)serialization

# HF GPT-2 implements these as Conv1D, whose weight is [in_features, out_features].
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def is_conv1d_weight(name: str) -> bool:
    return name.endswith(CONV1D_SUFFIXES)


def to_hf_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """nn.Linear layout -> HF layout for tensor `name` (a weight or its gradient)."""
    t = t.detach()
    if is_conv1d_weight(name):
        t = t.t()
    return t.contiguous()  # safetensors requires contiguous tensors


def from_hf_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """HF layout -> nn.Linear layout (the transpose is its own inverse)."""
    return to_hf_layout(name, t)


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """All parameters keyed by HF GPT-2 names, in HF layout."""
    return {name: to_hf_layout(name, p) for name, p in model.named_parameters()}


def hf_grad_dict(model: GPT, prefix: str = "grad.") -> dict[str, torch.Tensor]:
    """All parameter gradients as `<prefix><HF name>`, in HF layout (Conv1D grads transposed too)."""
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        out[prefix + name] = to_hf_layout(name, p.grad)
    return out


def load_hf_state_dict(model: GPT, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy HF-layout tensors (extra keys such as `input.*`/`grad.*` are ignored) into `model`."""
    params = dict(model.named_parameters())
    if strict:
        missing = [k for k in params if k not in tensors]
        assert not missing, f"missing keys: {missing}"
    with torch.no_grad():
        for name, p in params.items():
            if name not in tensors:
                continue
            src = from_hf_layout(name, tensors[name])
            assert src.shape == p.shape, f"{name}: stored {tuple(tensors[name].shape)} vs param {tuple(p.shape)}"
            p.copy_(src)


def save_safetensors(model: GPT, path: str, extra: dict[str, torch.Tensor] | None = None, metadata=None) -> None:
    from safetensors.torch import save_file

    tensors = hf_state_dict(model)
    if extra:
        overlap = tensors.keys() & extra.keys()
        assert not overlap, f"extra tensors collide with weights: {overlap}"
        tensors.update({k: v.detach().contiguous() for k, v in extra.items()})
    save_file(tensors, path, metadata=metadata)


def load_safetensors(model: GPT, path: str, strict: bool = True) -> dict[str, torch.Tensor]:
    """Load weights from `path` into `model`; returns every tensor in the file."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    load_hf_state_dict(model, tensors, strict=strict)
    return tensors
