"""kvq calibration package."""
