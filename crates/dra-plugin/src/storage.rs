//! The filesystem seam for state the plugin must not lose: the checkpoint and CDI specs.
//!
//! Every write goes through [`Fs`], a handful of syscall-sized operations, so tests can run the
//! claim lifecycle on a filesystem that loses whatever was not yet synced when the power goes
//! (see `tests/power_cut.rs`). [`RealFs`] is `std::fs`.

use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Syscall-sized filesystem operations. Nothing is durable until synced: file contents by
/// [`Fs::sync_file`], directory entries (creations, renames, removals) by [`Fs::sync_dir`].
pub trait Fs: Send + Sync + std::fmt::Debug {
    /// Reads a whole file.
    ///
    /// # Errors
    /// `NotFound` when it does not exist, any other I/O error.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Creates or truncates `path` and writes `bytes` (not synced).
    ///
    /// # Errors
    /// Any I/O error.
    fn write(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Writes `bytes` over the start of the existing file `path` in place, without truncating
    /// it (the file grows if `bytes` is longer); not synced. Until [`Fs::sync_file`], a power
    /// cut may leave any mix of the old and the new bytes (a torn write).
    ///
    /// # Errors
    /// `NotFound` when the file does not exist, any other I/O error.
    fn overwrite(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;
    /// Makes the file's contents, and its length, durable (`fdatasync`: metadata not needed to
    /// read the data back, such as its modification time, may stay behind).
    ///
    /// # Errors
    /// Any I/O error.
    fn sync_file(&self, path: &Path) -> io::Result<()>;
    /// Atomically replaces `to` with `from` (`rename`; durable after [`Fs::sync_dir`]).
    ///
    /// # Errors
    /// Any I/O error.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes the directory's entries durable (`fsync` of the directory).
    ///
    /// # Errors
    /// Any I/O error.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Removes a file.
    ///
    /// # Errors
    /// `NotFound` when it does not exist, any other I/O error.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// The files directly in `dir`; empty when `dir` does not exist.
    ///
    /// # Errors
    /// Any I/O error other than `NotFound`.
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    /// Creates `dir` and its parents.
    ///
    /// # Errors
    /// Any I/O error.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
}

/// The real filesystem.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl Fs for RealFs {
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }

    fn write(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        // Owner-only: checkpoint and CDI specs are for root (the plugin and the container
        // runtime). An existing file keeps its mode on open, so set it explicitly.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(bytes)
    }

    fn overwrite(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)?
            .write_all_at(bytes, 0)
    }

    fn sync_file(&self, path: &Path) -> io::Result<()> {
        // fdatasync: an in-place overwrite of allocated blocks then needs no journal commit
        // (the modification time is all that stays behind), and a new or grown file's length
        // is still made durable, as POSIX requires for the data to be read back.
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)?
            .sync_data()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::File::open(dir)?.sync_all()
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        match std::fs::read_dir(dir) {
            Ok(entries) => entries
                .map(|e| e.map(|e| e.path()))
                .filter(|p| p.as_ref().map_or(true, |p| p.is_file()))
                .collect(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        // Directories we create are owner-only; existing ones keep their mode.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
    }
}

/// Removes group and other permissions from `path` (a file becomes at most 0600, a directory
/// at most 0700); a missing path is fine.
///
/// # Errors
/// Any I/O error other than `NotFound`.
pub fn restrict_to_owner(path: &Path) -> io::Result<()> {
    let mode = match std::fs::metadata(path) {
        Ok(m) => m.permissions().mode(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if mode & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o700))?;
    }
    Ok(())
}

fn parent(path: &Path) -> io::Result<&Path> {
    path.parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no parent"))
}

/// `.<name>.tmp` beside `path`.
fn temp_path(path: &Path) -> io::Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    Ok(parent(path)?.join(format!(".{}.tmp", name.to_string_lossy())))
}

/// Replaces `path` with `bytes` so that after a crash or power cut it holds either the old or the
/// new content: write a temp file beside it, fsync it, rename it over `path`, fsync the directory.
///
/// # Errors
/// Any I/O error; the temp file is removed on failure where possible.
pub fn write_atomic(fs: &dyn Fs, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = parent(path)?;
    let tmp = temp_path(path)?;
    let result = fs
        .write(&tmp, bytes)
        .and_then(|()| fs.sync_file(&tmp))
        .and_then(|()| fs.rename(&tmp, path))
        .and_then(|()| fs.sync_dir(dir));
    if result.is_err() {
        let _ = fs.remove(&tmp);
    }
    result
}

/// Replaces `path` with `bytes` so that a reader sees either the old or the whole new content
/// (temp file beside it, rename), without making either durable: after a crash or power cut
/// `path` may be the old file, the new one, missing, or empty. For files rebuilt at start-up
/// from a durable record, where the two fsyncs of [`write_atomic`] would buy nothing.
///
/// # Errors
/// Any I/O error; the temp file is removed on failure where possible.
pub fn replace(fs: &dyn Fs, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = temp_path(path)?;
    let result = fs.write(&tmp, bytes).and_then(|()| fs.rename(&tmp, path));
    if result.is_err() {
        let _ = fs.remove(&tmp);
    }
    result
}

/// Removes `path` without syncing its directory (a crash may bring it back); a missing file is
/// success. For files whose return after a crash is reconciled anyway.
///
/// # Errors
/// Any I/O error other than `NotFound`.
pub fn remove_file(fs: &dyn Fs, path: &Path) -> io::Result<()> {
    match fs.remove(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Whether `path` is one of [`write_atomic`]'s temp files (left behind by a crash).
pub fn is_temp_file(path: &Path) -> bool {
    path.file_name()
        .map(|n| n.to_string_lossy())
        .is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp"))
}
