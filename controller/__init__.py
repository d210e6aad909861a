"""Morph policy and fleet controller. Importing this package stays light (no Ray, no model):
`controller.fleet` and `controller.client` bring in Ray and are imported by path where needed."""
from controller.directive import Directive
from controller.policy import PolicyRunner, decide
from controller.policy_config import FleetConfig, ModeSettings, PolicyConfig

__all__ = ["Directive", "FleetConfig", "ModeSettings", "PolicyConfig", "PolicyRunner", "decide"]
