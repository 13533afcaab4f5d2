from dplightning.optim.muon import DPMuon as DPMuon  # noqa: F401
