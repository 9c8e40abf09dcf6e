"""The scheduling framework: profiles (filters -> weighted scorers -> picker) run by a profile handler."""

from epp.scheduling.profile import SchedulerProfile, WeightedScorer
from epp.scheduling.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerProfile", "WeightedScorer"]
