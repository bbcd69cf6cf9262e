"""Default (popen) start, lp_ddp / zero2 / Lightning ddp with an IterableDataset over 2 persistent workers; rank 0
saves the weights. usage: popen_ddp.py STRATEGY OUTFILE   (ref: popen_ddp.py one OUTFILE)"""
from part2 import *
from lightning_parallel.strategies import LPDDPStrategy, LPShardedStrategy
if __name__ == "__main__":
    which, outp = sys.argv[1], sys.argv[2]
    strat = {"one": ("auto", 1, 1), "lp_ddp": (LPDDPStrategy(), 2, 2), "zero2": (LPShardedStrategy({"zero_stage": 2}), 2, 2),
             "ddp": ("ddp", 2, 2)}[which]
    m, tr = fit2(strat[0], strat[1], strat[2], gpt(Plain), 4, IterData(B // strat[2], "dp", workers=2, persistent=True, init=False))
    if tr.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in m.state_dict().items()}, outp)
        print("SAVED", which, tr.global_step, flush=True)
