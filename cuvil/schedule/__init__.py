"""Schedules and the polyhedral model (isl types stay inside this package)."""

from cuvil.schedule.schedule import Schedule
from cuvil.schedule.stage import Stage

__all__ = ["Schedule", "Stage"]
