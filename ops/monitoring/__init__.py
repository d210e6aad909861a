"""Prometheus and Grafana assets for MorphServe (see README.md in this folder)."""
