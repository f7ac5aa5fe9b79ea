"""Distribution below the models: the parallel dimensions (:mod:`.config`, :mod:`.layout`), the
collectives every rank enters (:mod:`.comm`) with their strict check of what NCCL would refuse
(:mod:`.strict`), and the network checks before step 1 (:mod:`.netcheck`). The process groups
themselves are built in :mod:`omni_trainer.mcore.parallel`."""
