"""What a run does when something goes wrong, in plain Python and ``torch.distributed`` (no Lightning import):

* :mod:`.watchdog` -- name the rank that is gone when a collective fails, and print every thread's stack on a fatal
  signal;
* :mod:`.interrupts` -- Ctrl-C as a preemption: every rank stops at the same step boundary.

The strategies call them from their set-up, ``on_exception`` and teardown.
"""
