"""Optimizers with DP plans: they declare what the DP strategy clips, noises and releases for them."""

from dplightning.optim.grape import DPGrape as DPGrape
from dplightning.optim.muon import DPMuon as DPMuon
