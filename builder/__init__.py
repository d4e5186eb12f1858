"""kvq builder package."""
