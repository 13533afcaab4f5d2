"""The small DDPM++/NCSN++ U-Net of DPDM (BigGAN residual blocks, GroupNorm only), class-conditional.

Follows ``model/ncsnpp.py`` of ``nv-tlabs/DPDM`` with its defaults (nf 32, ch_mult (1, 2, 2),
two res blocks per level, attention at 7×7 and in the middle, skip_rescale, no FIR, zero-
initialised last layers): 1,753,345 parameters for MNIST (28×28, 1 channel, 10 classes + the
"no class" label of classifier-free guidance). Every parameter sits in an ``nn.Conv2d``,
``nn.Linear``, ``nn.GroupNorm`` or ``nn.Embedding``, so the DP engines compute per-example
gradients from hooks; there is no BatchNorm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def positional_embedding(positions: Tensor, dim: int, max_positions: float = 10000.0) -> Tensor:
    """NCSN++'s ``[sin, cos]`` embedding, frequencies exp(−ln(max_positions)·i/(dim/2 − 1)).

    Not :func:`dplightning.models.embeddings.sinusoidal_embedding`: that one is DiT's
    ``[cos, sin]`` with a ``/(dim/2)`` spacing, and DPDM's checkpoints use this one.
    """
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_positions) * torch.arange(half, dtype=torch.float32, device=positions.device) / (half - 1)
    )
    args = positions.float().unsqueeze(-1) * freqs
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(channels // 4, 32), channels, eps=1e-6)


class ResBlock(nn.Module):
    """ResnetBlockBigGANpp: GN, SiLU, (up/down), conv, + Dense(SiLU(temb)), GN, SiLU, dropout, conv; (x + h)/√2.

    Args:
        in_ch: Input channels.
        out_ch: Output channels.
        temb_dim: Width of the noise-level embedding.
        up: Nearest-neighbour 2× upsampling inside the block.
        down: 2× average pooling inside the block.
        dropout: Dropout probability.
    """

    def __init__(
        self, in_ch: int, out_ch: int, temb_dim: int, up: bool = False, down: bool = False, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.up, self.down = up, down
        self.norm0 = _norm(in_ch)
        self.conv0 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.dense = nn.Linear(temb_dim, out_ch)
        self.norm1 = _norm(out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv1 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch or up or down else None
        _zero(self.conv1)

    def _resample(self, x: Tensor) -> Tensor:
        if self.up:
            return F.interpolate(x, scale_factor=2.0, mode="nearest")
        if self.down:
            return F.avg_pool2d(x, 2)
        return x

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        h = self._resample(F.silu(self.norm0(x)))
        x = self._resample(x)
        h = self.conv0(h) + self.dense(F.silu(temb))[:, :, None, None]
        h = self.conv1(self.dropout(F.silu(self.norm1(h))))
        if self.skip is not None:
            x = self.skip(x)
        return (x + h) / math.sqrt(2.0)


class AttnBlock(nn.Module):
    """AttnBlockpp: GroupNorm, single-head self-attention over the H·W positions, (x + h)/√2.

    The 1×1 projections are ``nn.Linear`` layers on channel-last tokens (the same parameters as
    NCSN++'s NIN layers); the output projection starts at zero.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)
        _zero(self.out)

    def forward(self, x: Tensor) -> Tensor:
        b, c, hgt, wid = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        h = self.out(F.scaled_dot_product_attention(q, k, v))
        return (x + h.transpose(1, 2).reshape(b, c, hgt, wid)) / math.sqrt(2.0)


def _zero(layer: nn.Module) -> None:
    """NCSN++'s init_scale = 0 (the block starts as the identity on its skip path)."""
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)


class NCSNppUNet(nn.Module):
    """F(x, c_noise, y): DPDM's DDPM++/NCSN++ network (``resblock_type='biggan'``, ``progressive='none'``).

    Args:
        image_size: Input height = width (28 for MNIST; 8 for the embedded digits).
        in_channels: Image channels.
        nf: Base width; the noise-level embedding has width nf and the block embedding 4·nf.
        ch_mult: Width multipliers per resolution level (one 2× down-sampling between levels).
        num_res_blocks: Res blocks per level on the way down (one more on the way up).
        attn_resolutions: Resolutions with self-attention (MNIST: (7,)).
        num_classes: Classes for conditioning; 0 for an unconditional model.
        use_cfg: Add the "no class" label ``num_classes`` for classifier-free guidance.
        dropout: Dropout in the res blocks (DPDM: 0).
    """

    def __init__(
        self,
        image_size: int = 28,
        in_channels: int = 1,
        nf: int = 32,
        ch_mult: Sequence[int] = (1, 2, 2),
        num_res_blocks: int = 2,
        attn_resolutions: Sequence[int] = (7,),
        num_classes: int = 10,
        use_cfg: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % 2 ** (len(ch_mult) - 1):
            raise ValueError(
                f"image_size {image_size} is not divisible by 2^{len(ch_mult) - 1} (ch_mult {tuple(ch_mult)})."
            )
        if nf % 8 or nf < 8:
            raise ValueError(f"nf must be a multiple of 8 (GroupNorm groups are channels // 4), got {nf}.")
        self.nf, self.num_classes, self.use_cfg = nf, num_classes, use_cfg
        self.image_size, self.in_channels = image_size, in_channels
        temb = 4 * nf
        self.label_embedding = nn.Embedding(num_classes + int(use_cfg), nf) if num_classes > 0 else None
        self.temb0, self.temb1 = nn.Linear(nf, temb), nn.Linear(temb, temb)
        self.conv_in = nn.Conv2d(in_channels, nf, 3, padding=1)
        self.down = nn.ModuleList()
        skips, ch, res = [nf], nf, image_size
        for level, mult in enumerate(ch_mult):
            for _ in range(num_res_blocks):
                self.down.append(ResBlock(ch, nf * mult, temb, dropout=dropout))
                ch = nf * mult
                if res in attn_resolutions:
                    self.down.append(AttnBlock(ch))
                skips.append(ch)
            if level != len(ch_mult) - 1:
                self.down.append(ResBlock(ch, ch, temb, down=True, dropout=dropout))
                skips.append(ch)
                res //= 2
        self.mid = nn.ModuleList(
            [ResBlock(ch, ch, temb, dropout=dropout), AttnBlock(ch), ResBlock(ch, ch, temb, dropout=dropout)]
        )
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(ch_mult))):
            for _ in range(num_res_blocks + 1):
                self.up.append(ResBlock(ch + skips.pop(), nf * mult, temb, dropout=dropout))
                ch = nf * mult
            if res in attn_resolutions:
                self.up.append(AttnBlock(ch))
            if level != 0:
                self.up.append(ResBlock(ch, ch, temb, up=True, dropout=dropout))
                res *= 2
        self.norm_out = _norm(ch)
        self.conv_out = nn.Conv2d(ch, in_channels, 3, padding=1)
        self._init_weights()

    def _init_weights(self) -> None:
        """NCSN++'s default_init (Xavier uniform, zero bias); the init_scale-0 layers stay zero."""
        zeroed = {id(m.conv1) for m in self.modules() if isinstance(m, ResBlock)}
        zeroed |= {id(m.out) for m in self.modules() if isinstance(m, AttnBlock)}
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)) and id(m) not in zeroed:
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        _zero(self.conv_out)

    def forward(self, x: Tensor, c_noise: Tensor, labels: Tensor | None = None) -> Tensor:
        """``x`` ``[B, C, H, W]``, ``c_noise`` ``[B]``, ``labels`` ``[B]`` (``num_classes`` = no class)."""
        emb = positional_embedding(c_noise, self.nf)
        if self.label_embedding is not None:
            if labels is None:
                if not self.use_cfg:
                    raise ValueError(
                        "This class-conditional network needs labels (use_cfg=False has no 'no class' label)."
                    )
                labels = torch.full((x.shape[0],), self.num_classes, dtype=torch.long, device=x.device)
            emb = emb + self.label_embedding(labels)
        temb = self.temb1(F.silu(self.temb0(emb)))
        hs = [self.conv_in(x)]
        for block in self.down:
            if isinstance(block, AttnBlock):
                hs[-1] = block(hs[-1])
            else:
                hs.append(block(hs[-1], temb))
        h = hs[-1]
        for block in self.mid:
            h = block(h) if isinstance(block, AttnBlock) else block(h, temb)
        for block in self.up:
            if isinstance(block, AttnBlock):
                h = block(h)
            elif block.up:
                h = block(h, temb)
            else:
                h = block(torch.cat([h, hs.pop()], dim=1), temb)
        return self.conv_out(F.silu(self.norm_out(h)))
