//! Rebuilds the crate when a migration changes: `sqlx::migrate!` embeds `../migrations` at compile
//! time, and cargo does not know about that directory otherwise.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
    println!("cargo:rerun-if-env-changed=TAPEDECK_GIT_REVISION");
}
