"""kvq recipes package."""
