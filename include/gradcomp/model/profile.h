// Profile: what the planner knows of a model: its gradients in backward order, with element
// counts and the time each becomes ready after the backward pass starts, and the forward and
// backward times, all on one worker without communication. Data under profiles/ (JSON, schema
// in docs/simulation.md); recorded on this machine by gradcomp.torch.profile().
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gradcomp/plan.h"

namespace gradcomp::model {

struct ProfileTensor {
  std::string name;
  size_t elements = 0;
  double ready_s = 0;  // seconds after the start of backward; nondecreasing in backward order
  bool operator==(const ProfileTensor&) const = default;
};

struct Profile {
  std::string model;       // "resnet50"
  std::string source;      // where the shapes and times come from, in words
  int batch_size = 0;      // per worker
  double forward_s = 0;
  double backward_s = 0;   // >= the last ready_s
  std::vector<ProfileTensor> tensors;  // backward order
  bool operator==(const Profile&) const = default;

  size_t total_elements() const;
  std::vector<TensorInfo> tensor_infos() const;  // for plans
  // The profile of a plan's pieces (Plan::pieces of a plan of this profile's tensors): every
  // slice of a tensor becomes ready when the tensor does.
  Profile by_piece(const std::vector<TensorPiece>& pieces) const;
  // Throws Error naming the field path ("tensors[3].elements", "backward_s") that is missing,
  // of the wrong type, negative, or out of order.
  static Profile from_json(const nlohmann::json& json);
  nlohmann::json to_json() const;
  void validate() const;
};

// A profile by name ("resnet50": profiles/resnet50.json in GRADCOMP_PROFILES or the shipped
// directory) or by path (anything with a '/' or ending in .json).
Profile load_profile(const std::string& name_or_path);
// The names of the shipped profiles.
std::vector<std::string> profile_names();
// Where profiles and codec-costs.json are read: GRADCOMP_PROFILES, else the shipped profiles/.
std::string profiles_directory();

}  // namespace gradcomp::model
