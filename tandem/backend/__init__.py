"""Tandem backend package."""
