"""Flow control: requests wait in the EPP, by priority band, fairness and order, until the pool can take them.

``FlowController.admit`` is the director's gate (with the ``flowControl`` feature gate on); the
policies it applies are plugins (``epp.framework`` contracts), the queues are its own.
"""

from epp.flowcontrol.controller import FlowController, Permit
from epp.flowcontrol.settings import BandSettings, FlowControlSettings, settings_from_spec

__all__ = ["BandSettings", "FlowControlSettings", "FlowController", "Permit", "settings_from_spec"]
