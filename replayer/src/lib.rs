//! replayer
