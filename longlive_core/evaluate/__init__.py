"""Scoring generated videos: the metrics that need no weights, contact sheets and the regression verdict."""
