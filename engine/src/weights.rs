//! Reading checkpoint tensors from `*.safetensors` files into f32 host memory.
//!
//! The CPU reference computes in f32, so every tensor is converted once at load (f16 and bf16
//! widen exactly). Sharded checkpoints are found through `model.safetensors.index.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::tokenizer::read_json;

/// A tensor converted to f32, with the dtype it was stored in.
#[derive(Debug, Clone)]
pub struct HostTensor {
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
    /// The dtype in the file; a bf16 tensor's values are already bf16-exact.
    pub stored_as: Dtype,
}

/// All tensors of a checkpoint, by name.
pub struct WeightStore {
    tensors: HashMap<String, (HostTensor, String)>,
    files: Vec<String>,
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

fn convert(
    name: &str,
    file: &str,
    view: &safetensors::tensor::TensorView<'_>,
) -> Result<HostTensor> {
    let bytes = view.data();
    let data: Vec<f32> = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype {
                name: name.into(),
                file: file.into(),
                dtype: format!("{other:?}"),
            })
        }
    };
    Ok(HostTensor {
        shape: view.shape().to_vec(),
        data,
        stored_as: view.dtype(),
    })
}

impl WeightStore {
    /// Loads every tensor of the checkpoint in `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let files = Self::files(dir)?;
        let mut tensors = HashMap::new();
        let mut names = Vec::new();
        for path in &files {
            let fname = file_name(path);
            let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
            let st = SafeTensors::deserialize(&bytes).map_err(|e| Error::Safetensors {
                file: fname.clone(),
                message: e.to_string(),
            })?;
            for (name, view) in st.tensors() {
                let t = convert(&name, &fname, &view)?;
                tensors.insert(name, (t, fname.clone()));
            }
            names.push(fname);
        }
        Ok(WeightStore {
            tensors,
            files: names,
        })
    }

    /// The safetensors files of a checkpoint: the shards named by the index, else
    /// `model.safetensors`, else every `*.safetensors` in the directory.
    fn files(dir: &Path) -> Result<Vec<PathBuf>> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let v = read_json(&index)?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::BadJson {
                    path: index.clone(),
                    message: "no weight_map object".into(),
                })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect();
            shards.sort();
            shards.dedup();
            let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
            for p in &paths {
                if !p.exists() {
                    return Err(Error::MissingFile {
                        dir: dir.to_path_buf(),
                        file: file_name(p),
                    });
                }
            }
            return Ok(paths);
        }
        let single = dir.join("model.safetensors");
        if single.exists() {
            return Ok(vec![single]);
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        found.sort();
        if found.is_empty() {
            return Err(Error::MissingFile {
                dir: dir.to_path_buf(),
                file: "model.safetensors (or model.safetensors.index.json)".into(),
            });
        }
        Ok(found)
    }

    /// Takes a tensor out of the store, checking its shape.
    pub fn take(&mut self, name: &str, expected: &[usize]) -> Result<HostTensor> {
        let (t, file) = self
            .tensors
            .remove(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.into(),
                files: self.files.join(", "),
            })?;
        if t.shape != expected {
            return Err(Error::ShapeMismatch {
                name: name.into(),
                file,
                expected: expected.to_vec(),
                found: t.shape,
            });
        }
        Ok(t)
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of tensors not taken yet (to warn about unused weights).
    pub fn remaining(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().cloned().collect();
        v.sort();
        v
    }
}
