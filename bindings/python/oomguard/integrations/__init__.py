"""oomguard inside the trainers people use. One module a trainer, each an
optional extra that imports its trainer only when imported itself:

=====================  =========================================================
``hf``                 ``transformers.Trainer``: ``OomguardTrainer`` (a Trainer
                       subclass) or ``GuardedTrainerMixin`` for your own
                       subclass; ``pip install oomguard[hf]``
``lightning``          Lightning's ``Trainer``: ``OomguardCallback`` (automatic
                       optimisation) and ``GuardedDDPStrategy`` (several ranks);
                       ``pip install oomguard[lightning]``
``accelerate``         a loop that uses ``Accelerator.prepare``: ``train_step``
                       builds the guarded step; ``pip install oomguard[accelerate]``
=====================  =========================================================

Each one guards every optimizer step with ``oomguard.torch.TrainStep``: the
trainer's batches of one optimizer step (its gradient accumulation) become one
guarded step, split into micro-batches that fit, with the same global batch
and the same gradient. See docs/integrations/.
"""
