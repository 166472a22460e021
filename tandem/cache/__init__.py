"""Tandem cache package."""
