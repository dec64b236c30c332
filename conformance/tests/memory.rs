//! The reference store passes the whole suite.

dedupe_conformance::suite!(dedupe_conformance::MemoryFactory);
